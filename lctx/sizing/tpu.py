"""Compile-only TPU slices: libtpu describes a slice without the hardware.

`topology_devices('v5p:4x4x4')` gives devices that take a real mesh and a real
compile (`jax.experimental.topologies`); the GPU counterpart is
lctx/sizing/gpu.py, and `lctx.sizing.compile.compile_devices` picks one by name.
"""

from __future__ import annotations

import importlib.util

from lctx import hardware
from lctx.errors import ConfigError
from lctx.sizing import devices as devices_lib

INSTALL_HINT = (
  "--mode=compile needs libtpu, the TPU compiler (no TPU needed): "
  "pip install -e '.[tpu]'  (it brings jax[tpu] and libtpu)"
)


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """Compile-only devices of `num_slices` slices of `topology` ('v5p:4x4x4')."""
  hardware.topology_accelerator(topology)  # a known kind, or a clear error
  hardware.topology_chips(topology)
  if num_slices < 1:
    raise ConfigError(f"--compile_topology_num_slices must be >= 1; got {num_slices}.")
  devices_lib.compile_only_env()
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
