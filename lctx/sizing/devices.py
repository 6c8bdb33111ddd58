"""Compile-only accelerator devices: TPU slices (libtpu) and GPU nodes (the CUDA plugin).

`compile_devices('v5p:4x4x4')` or `compile_devices('h100x8')` gives devices that
take a real mesh and a real compile without the hardware being there. The
environment these libraries read when they load is set in `compile_only_env`,
the one place lctx sets it; call it before jax starts (scripts and tests that
load libtpu at import time do).
"""

from __future__ import annotations

import importlib.util
import os

from lctx import hardware
from lctx.errors import ConfigError

INSTALL_HINT = (
  "--mode=compile needs libtpu, the TPU compiler (no TPU needed): "
  "pip install -e '.[tpu]'  (it brings jax[tpu] and libtpu)"
)
COMPILE_ONLY_ENV = {
  # Other processes on this machine may hold libtpu too.
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  # There is no TPU metadata server to ask.
  "TPU_SKIP_MDS_QUERY": "1",
  # Without the metadata server libtpu finds no worker list and logs an E0000
  # error; compile-only devices live in this one process.
  "TPU_WORKER_HOSTNAMES": "localhost",
}
GPU_COMPILE_ONLY_ENV = {
  # Without a GPU the CUDA plugin's library version check fails and the plugin
  # is not registered (so no topology); read when jax discovers its plugins.
  "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
}


def compile_only_env(gpu: bool = False) -> None:
  """Sets COMPILE_ONLY_ENV (read when libtpu loads, at the first topology
  call), and with `gpu` GPU_COMPILE_ONLY_ENV (read when jax discovers its
  plugins); values already set are kept."""
  for name, value in {**COMPILE_ONLY_ENV, **(GPU_COMPILE_ONLY_ENV if gpu else {})}.items():
    os.environ.setdefault(name, value)


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """Compile-only devices of `num_slices` slices of `topology` ('v5p:4x4x4')."""
  hardware.topology_accelerator(topology)  # a known kind, or a clear error
  hardware.topology_chips(topology)
  if num_slices < 1:
    raise ConfigError(f"--compile_topology_num_slices must be >= 1; got {num_slices}.")
  compile_only_env()
  if importlib.util.find_spec("libtpu") is None:
    raise RuntimeError(INSTALL_HINT)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(
      platform="tpu", topology_name=topology, num_slices=num_slices
    )
  except Exception as err:  # pylint: disable=broad-except
    raise ConfigError(
      f"libtpu cannot describe topology {topology!r} x {num_slices} slice(s): {err}. "
      "Names look like 'v5p:4x4x4', 'tpu7x:4x4x4', 'v6e:2x2'."
    ) from err
  return list(desc.devices)


def compile_devices(topology: str, num_slices: int = 1):
  """(devices, accelerator row, HBM bytes per device, chips) to compile for.

  `topology` is a TPU slice ('v5p:4x4x4': libtpu's compile-only devices) or a
  GPU node ('h100x8': the CUDA plugin's, lctx/sizing/gpu.py). For GPUs the HBM
  is the device memory CUDA reports (a little under the table's nominal size).
  """
  if ":" in topology:
    accel = hardware.topology_accelerator(topology)
    devices = topology_devices(topology, num_slices)
    chips = hardware.topology_chips(topology) * num_slices
    return devices, accel, accel.hbm_bytes_per_device, chips
  target = hardware.parse_target(topology)
  accel = target.accelerator
  if accel.platform != "gpu":
    raise ConfigError(
      f"--compile_topology={topology!r}: a TPU slice is named by its topology, "
      "e.g. 'v5p:4x4x4' or 'tpu7x:4x4x4'; GPU nodes by '<kind>x<gpus>', e.g. 'h100x8'."
    )
  if num_slices != 1:
    raise ConfigError(
      f"--compile_topology_num_slices={num_slices}: GPU nodes are named whole "
      f"('h100x16' for two nodes), not as slices; got {topology!r}."
    )
  from lctx.sizing import gpu as compile_gpu  # pylint: disable=g-import-not-at-top

  devices = compile_gpu.gpu_topology_devices(accel.name, target.chips)
  return devices, accel, compile_gpu.GPU_SPECS[accel.name].device_memory_size, target.chips
