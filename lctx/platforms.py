"""The jax platform a run starts, and whether it is the hardware its gin file is for.

jax starts every installed plugin on first use. On a machine without that
accelerator the CUDA plugin prints a traceback ("Error loading CUDA libraries")
and libtpu an `E0000 ... unexpected worker hostname` line, though the run goes
on, on the CPU. So a run whose devices are the CPU names that platform before
any backend starts:
  - fake host devices (`--fake_devices`, a gin file's `LOCAL_DEVICES`);
  - `--mode=compile` and `--mode=plan`: they run on the host CPU; compile asks
    libtpu or the CUDA plugin for compile-only devices, which loads that one
    library (lctx/sizing/tpu.py, lctx/sizing/gpu.py);
  - a machine where jax's own probe (PCI vendor ids, /dev/nvidia*) finds no TPU
    or GPU.
TPU and GPU hosts keep jax's own choice, and a JAX_PLATFORMS the user set wins.

It also holds the checks for a platform's own limits that the trainer runs
before compiling (a setup libtpu aborts on instead of raising).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

from lctx.errors import ConfigError

# XLA's CPU collectives end the process when one fake device waits 40 s for the
# others at a rendezvous. Fake devices are threads of one process, so on an
# oversubscribed CPU a late thread is slow, not hung: wait far longer.
CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
CPU_COLLECTIVE_TIMEOUT_SECONDS = 1200


def set_fake_devices(n: int | None) -> None:
  """`n` host CPU devices; read when jax starts its CPU backend."""
  if n and "jax" not in sys.modules:
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    if CPU_COLLECTIVE_TIMEOUT_FLAG not in flags:
      flags += f" {CPU_COLLECTIVE_TIMEOUT_FLAG}={CPU_COLLECTIVE_TIMEOUT_SECONDS}"
    os.environ["XLA_FLAGS"] = flags


def choose(cpu_only: bool) -> None:
  """Runs jax on the CPU alone when `cpu_only` or when no accelerator is visible."""
  if os.environ.get("JAX_PLATFORMS"):
    return
  import jax  # pylint: disable=g-import-not-at-top

  if cpu_only or not _accelerator_visible():
    os.environ["JAX_PLATFORMS"] = "cpu"  # for subprocesses (data workers) too
    jax.config.update("jax_platforms", "cpu")


def _accelerator_visible() -> bool:
  """jax's own hardware probe (the one it uses to suggest a missing plugin)."""
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top

    return bool(
      hardware_utils.num_available_tpu_chips_and_device_id()[0]
      or hardware_utils.has_visible_nvidia_gpu()
      or hardware_utils.num_available_amd_gpus(stop_at=1)
    )
  except Exception:  # pylint: disable=broad-except
    return True  # cannot tell: leave the choice to jax


def check_target(
  mesh_config, target: str | None, gin_files: Sequence[str], gin_params: Sequence[str]
) -> None:
  """A ConfigError when a file written for `target` ('tpu7x:4x4x4', 'h100x8') has
  a mesh this machine's devices cannot hold; it names the command that checks
  the file from here instead (--mode=compile)."""
  import jax  # pylint: disable=g-import-not-at-top

  from lctx import hardware  # pylint: disable=g-import-not-at-top
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  if not target:
    return
  count = jax.device_count()
  try:
    mesh_lib.resolve_mesh_shape(mesh_config, count)
    return  # the mesh fits here (e.g. overridden for a smaller slice)
  except ValueError:
    pass
  wanted = hardware.parse_target(target)
  command = shlex.join(
    [
      "python",
      "main.py",
      "--mode=compile",
      *(f"--gin_file={f}" for f in gin_files),
      *(f"--gin_param={p}" for p in gin_params),
    ]
  )
  raise ConfigError(
    f"{', '.join(gin_files) or 'this config'} is for {target} ({wanted.devices} devices); "
    f"this machine has {count} {jax.devices()[0].device_kind} devices.",
    fix=f"Check it from here with: {command} (or fit MeshConfig to these devices).",
  )


# libtpu 0.0.42.1 aborts the whole process (llo_loop.cc:165, no Python error)
# compiling a layer scan that offloads one value of this many elements or more
# per device (the case it was found on: docs/benchmarks.md, "Figures moved from
# code comments").
OFFLOAD_ELEMENT_LIMIT = 2**31


def check_offloaded_input_size(model_cfg, train_cfg, mesh, batch_ways, seq_ways) -> None:
  """Refuses, before the compiler can abort, a TPU setup whose offloaded layer
  input (per piece) reaches OFFLOAD_ELEMENT_LIMIT elements per device."""
  choices = model_cfg.remat_choices or {}
  if mesh.devices.flat[0].platform != "tpu" or choices.get("layer_input") != "offload":
    return
  rows = max(1, train_cfg.batch_size // batch_ways)
  tokens = train_cfg.seq_len // seq_ways
  per_piece = rows * tokens * model_cfg.d_model // model_cfg.layer_input_pieces
  if per_piece >= OFFLOAD_ELEMENT_LIMIT:
    need = next(
      k
      for k in range(model_cfg.layer_input_pieces + 1, model_cfg.d_model + 1)
      if model_cfg.d_model % k == 0
      and rows * tokens * model_cfg.d_model // k < OFFLOAD_ELEMENT_LIMIT
    )
    raise ValueError(
      f"the offloaded layer input is {rows} x {tokens:,} x {model_cfg.d_model} = "
      f"{rows * tokens * model_cfg.d_model:,} elements per device in "
      f"{model_cfg.layer_input_pieces} piece(s); libtpu aborts the compile at 2**31 "
      f"elements per offloaded value. Set ModelConfig.layer_input_pieces = {need}."
    )
