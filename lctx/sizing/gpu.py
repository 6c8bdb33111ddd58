r"""Compile-only NVIDIA GPU devices: a GPU node's program compiled without a GPU.

The CUDA PJRT plugin describes GPUs it cannot see when handed a
`GpuTargetConfigProto` (text format): its `target_config` topology option.
`jax.experimental.topologies.get_topology_desc(platform='cuda', ...)` then gives
compile-only devices, as libtpu does for TPU slices (lctx/sizing/tpu.py); jit's
`.lower(...).compile()` on them runs the real XLA GPU compiler (PTX by LLVM,
cubin by ptxas) and `.memory_analysis()` gives per-device bytes.

    devices = gpu_topology_devices("h100", 8)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", "model"))

Needs (no GPU, no CUDA driver), see INSTALL_HINT: the CUDA 12 plugin wheels
(jax-cuda12-plugin, jax-cuda12-pjrt, same version as jax) and ptxas + libdevice
(nvidia-cuda-nvcc-cu12, or a CUDA toolkit under /usr/local/cuda or on PATH):
this plugin build has no linked-in PTX compiler. cuDNN attention
(`implementation='cudnn'`) also needs nvidia-cudnn-cu12 at trace time.

What differs from a compile on a real GPU (checked with jax 0.10.2):
  - no autotuning (GEMM tilings from heuristics);
  - cuDNN fused attention keeps a zero-byte workspace (`u8[0]`): cuDNN graphs
    are neither built nor checked, so their workspace is missing from the bytes;
  - sorts take XLA's fallback algorithm (no CUB scratch data for the device);
  - the GPU compiler raises no out-of-memory: rematerialisation aims at about
    76% of `device_memory_size`, logs "Can't reduce memory use below ..." when
    it cannot get there, and compiles anyway. Whether a program fits is for
    the caller to judge from `memory_analysis()`, not an exception.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util

from lctx import hardware
from lctx.errors import ConfigError
from lctx.sizing import devices as devices_lib


def install_hint() -> str:
  try:
    v = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    v = "<jax version>"
  return (
    "compile-only GPU devices need the CUDA PJRT plugin and ptxas/libdevice "
    "(no GPU or CUDA driver needed): pip install -e '.[gpu_compile]', i.e. "
    f"jax-cuda12-plugin=={v} (it brings jax-cuda12-pjrt) and nvidia-cuda-nvcc-cu12 "
    "(and nvidia-cudnn-cu12 for cuDNN attention)"
  )


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What the GPU compiler is told about one device.

  Attributes:
    name: the CUDA device name, which becomes `jax.Device.device_kind`.
    device_memory_size: bytes of device memory as CUDA reports it (a little
      under the marketing figure in `lctx.hardware`); XLA's rematerialisation
      and scheduler size their memory limit from it.
    memory_bandwidth: HBM bytes/s.
    clock_rate_ghz: SM boost clock.
    core_count: SMs.
    l2_cache_size: bytes.
    compute_capability: (major, minor); 9.0 is Hopper (XLA targets sm_90a).
  """

  name: str
  device_memory_size: int
  memory_bandwidth: int
  clock_rate_ghz: float
  core_count: int
  l2_cache_size: int
  compute_capability: tuple[int, int]


# Hopper SXM (GH100, 132 SMs): NVIDIA's H100/H200 data sheets and the CUDA
# device properties of the real parts (the memory sizes are the totals CUDA
# reports, as recorded in XLA's device specs
# xla/backends/gpu/target_config/specs/{h100_sxm,h200}.txtpb).
GPU_SPECS: dict[str, GpuSpec] = {
  "h100": GpuSpec(
    name="NVIDIA H100 80GB HBM3",
    device_memory_size=84_942_979_072,
    memory_bandwidth=3_352_320_000_000,
    clock_rate_ghz=1.98,
    core_count=132,
    l2_cache_size=50 * 2**20,
    compute_capability=(9, 0),
  ),
  "h200": GpuSpec(
    name="NVIDIA H200 141GB HBM3e",
    device_memory_size=151_397_597_184,
    memory_bandwidth=4_800_000_000_000,
    clock_rate_ghz=1.98,
    core_count=132,
    l2_cache_size=50 * 2**20,
    compute_capability=(9, 0),
  ),
}

# Per-SM limits common to Hopper (CUDA device properties of sm_90).
_HOPPER_LIMITS = """\
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  fpus_per_core: 128
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_address_bits: 64
"""


def target_config(spec: GpuSpec, device_memory_size: int | None = None) -> str:
  """A `stream_executor.GpuTargetConfigProto` in text format for `spec`."""
  major, minor = spec.compute_capability
  mem = spec.device_memory_size if device_memory_size is None else int(device_memory_size)
  return (
    "gpu_device_info {\n"
    f"{_HOPPER_LIMITS}"
    f"  core_count: {spec.core_count}\n"
    f"  memory_bandwidth: {spec.memory_bandwidth}\n"
    f"  l2_cache_size: {spec.l2_cache_size}\n"
    f"  clock_rate_ghz: {spec.clock_rate_ghz}\n"
    f"  device_memory_size: {mem}\n"
    f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n  }}\n"
    '  device_vendor: "NVIDIA Corporation"\n'
    f'  name: "{spec.name}"\n'
    "}\n"
    'platform_name: "CUDA"\n'
    "dnn_version_info {\n  major: 9\n  minor: 8\n  patch: 0\n}\n"
    f'device_description_str: "{spec.name}"\n'
  )


def topology_shape(kind: str, count: int) -> str:
  """The plugin's '<partitions>x<hosts per partition>x<devices per host>'.

  One host holds up to `chips_per_host` GPUs (8 for h100 / h200 in
  `lctx.hardware`); more devices are whole hosts of that many.
  """
  per_host = hardware.accelerator(kind).devices_per_host
  if count < 1:
    raise ConfigError(f"count must be >= 1; got {count}")
  if count <= per_host:
    return f"1x1x{count}"
  if count % per_host:
    raise ConfigError(f"{count} {kind} GPUs: more than one host needs a multiple of {per_host}")
  return f"1x{count // per_host}x{per_host}"


def gpu_topology_devices(
  kind: str = "h100", count: int = 8, *, device_memory_size: int | None = None
) -> list:
  """`count` compile-only GPU devices of `kind` ('h100', 'h200'); no GPU needed.

  Args:
    kind: a GPU row of `lctx.hardware` with a spec in `GPU_SPECS`.
    count: devices; past one host (8 GPUs) a multiple of 8, one process each.
    device_memory_size: overrides the spec's device memory (bytes).

  Raises:
    RuntimeError: the CUDA plugin is not installed (with the pip line).
    ValueError: an unknown kind or count, or the plugin refused the topology.
  """
  acc = hardware.accelerator(kind)
  if acc.platform != "gpu" or acc.name not in GPU_SPECS:
    raise ConfigError(f"no GPU spec for {kind!r}; known: {', '.join(sorted(GPU_SPECS))}")
  shape = topology_shape(acc.name, count)
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    raise RuntimeError(install_hint())
  devices_lib.compile_only_env(gpu=True)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(
      platform="cuda",
      topology_name="",
      target_config=target_config(GPU_SPECS[acc.name], device_memory_size),
      topology=shape,
    )
  except NotImplementedError as err:
    # The plugin was found but not registered (jax discovered its plugins
    # before JAX_SKIP_CUDA_CONSTRAINTS_CHECK was set, or the plugin failed).
    raise RuntimeError(
      f"the CUDA plugin gave no topology ({err}); set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "
      "(or JAX_PLATFORMS=cpu) before jax starts. " + install_hint()
    ) from err
  except Exception as err:  # pylint: disable=broad-except
    raise ConfigError(f"the CUDA plugin cannot describe {count} x {kind} ({shape}): {err}") from err
  return list(desc.devices)
