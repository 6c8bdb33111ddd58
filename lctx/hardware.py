"""Accelerator facts in one table: memory per device and per host VM.

`--mode=compile` reads it to judge whether a compiled step fits a TPU slice, and
`--mode=plan` to size setups for TPU slices and GPU nodes. Sources: Google's TPU
system-architecture pages and NVIDIA's data sheets; TPU HBM figures are what the
TPU compiler itself enforces where it reported one (its RESOURCE_EXHAUSTED
message names the available HBM).

Names:
  - a topology for the TPU compiler: 'v5p:4x4x4', 'tpu7x:4x4x4', 'v6e:2x2' ...
    (`jax.experimental.topologies.get_topology_desc(platform='tpu', ...)`);
  - a planner target: '<kind>-<chips>' for TPU slices ('v5p-64', 'tpu7x-64')
    or '<kind>x<gpus>' for GPU nodes ('h100x8', 'h200x8').
"""

from __future__ import annotations

import dataclasses
import math
import re

from lctx.errors import ConfigError

GiB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One accelerator kind.

  Attributes:
    name: the kind as the TPU compiler's topology names spell it ('v5p', ...).
    hbm_bytes_per_chip: HBM of one chip.
    devices_per_chip: JAX devices one chip exposes (TPU7x: two TensorCores).
    chips_per_host: chips attached to one host VM (one process).
    host_ram_bytes_per_host: RAM of that host VM.
    peak_bf16_flops_per_chip: dense bf16 peak, for MFU and step-time estimates.
    platform: 'tpu' or 'gpu'.
    compiler_hbm_bytes_per_device: the HBM per device the TPU compiler itself
      enforces (the "available HBM" of its RESOURCE_EXHAUSTED message, printed
      in GiB to two decimals); 0 where not measured. A little less than the
      chip's share: the runtime keeps some for itself.
    hbm_bandwidth_per_chip: HBM bytes/s.
    ici_bandwidth_per_chip: bytes/s of the chip's fast interconnect, all links
      together (TPU ICI, NVIDIA NVLink), as the data sheet states it.
    dcn_bandwidth_per_chip: bytes/s of the chip's share of the network between
      slices / nodes (TPU DCN, InfiniBand).
    host_bandwidth_per_chip: bytes/s between the chip and its host's RAM, one
      direction (PCIe), what offloading pays.
    bandwidth_sources: where the bandwidths come from, and which are assumed.
  """

  name: str
  hbm_bytes_per_chip: int
  devices_per_chip: int
  chips_per_host: int
  host_ram_bytes_per_host: int
  peak_bf16_flops_per_chip: float
  platform: str
  compiler_hbm_bytes_per_device: int = 0
  hbm_bandwidth_per_chip: float = 0.0
  ici_bandwidth_per_chip: float = 0.0
  dcn_bandwidth_per_chip: float = 0.0
  host_bandwidth_per_chip: float = 0.0
  bandwidth_sources: str = ""

  @property
  def hbm_bytes_per_device(self) -> int:
    """HBM one device may use: the compiler's own limit where measured."""
    if self.compiler_hbm_bytes_per_device:
      return self.compiler_hbm_bytes_per_device
    return self.hbm_bytes_per_chip // self.devices_per_chip

  @property
  def devices_per_host(self) -> int:
    return self.chips_per_host * self.devices_per_chip


# Bandwidths. TPU: Google Cloud's system-architecture pages (cloud.google.com/tpu/docs/
# v5p, v5e, v6e: HBM GB/s and ICI Gbps per chip) and Google's Ironwood announcement
# (7.37 TB/s HBM, 1.2 TB/s bidirectional ICI per chip). ASSUMED, not published per
# chip: DCN as a 200 Gbps (v5e: 100 Gbps) host NIC shared by the host's 4 chips, and
# host <-> chip as PCIe Gen4 x16 (32 GB/s one way).
_TPU_SOURCES = (
  "HBM, ICI: Google Cloud TPU system architecture pages / Ironwood announcement; "
  "DCN (host NIC / 4 chips) and host PCIe (Gen4 x16): assumed"
)
# GPU: NVIDIA H100 / H200 SXM data sheets (HBM3 3.35 TB/s, HBM3e 4.8 TB/s, NVLink
# 900 GB/s, PCIe Gen5 x16 64 GB/s one way); the network as one 400 Gb/s NDR
# InfiniBand NIC per GPU (DGX H100 / H200 reference design).
_GPU_SOURCES = (
  "NVIDIA H100/H200 SXM data sheets (HBM, NVLink, PCIe Gen5); network: one NDR 400 Gb/s "
  "InfiniBand NIC per GPU (DGX reference design)"
)

ACCELERATORS: dict[str, Accelerator] = {
  a.name: a
  for a in (
    # TPU HBM limits below are the compiler's "exceeds available HBM (Y G)"
    # (G = GiB) for a deliberately oversized program compiled on compile-only
    # devices, libtpu 0.0.42.1 (jax 0.10.2): v5p 95.74, v5e 15.75,
    # v6e 31.25, tpu7x 94.75 GiB per device.
    # v5p: 95 GiB HBM2e per chip, one device per chip (megacore), 4 chips and
    # 448 GB of RAM per VM.
    Accelerator(
      "v5p",
      95 * GiB,
      1,
      4,
      448 * GB,
      459e12,
      "tpu",
      int(95.74 * GiB),
      hbm_bandwidth_per_chip=2765 * GB,
      ici_bandwidth_per_chip=4800e9 / 8,
      dcn_bandwidth_per_chip=200e9 / 8 / 4,
      host_bandwidth_per_chip=32 * GB,
      bandwidth_sources=_TPU_SOURCES,
    ),
    # v5e / v6e (Trillium): 16 / 32 GiB per chip, 4 chips per VM here (ct5lp /
    # ct6e-standard-4t: 192 / 720 GB).
    Accelerator(
      "v5e",
      16 * GiB,
      1,
      4,
      192 * GB,
      197e12,
      "tpu",
      int(15.75 * GiB),
      hbm_bandwidth_per_chip=819 * GB,
      ici_bandwidth_per_chip=1600e9 / 8,
      dcn_bandwidth_per_chip=100e9 / 8 / 4,
      host_bandwidth_per_chip=32 * GB,
      bandwidth_sources=_TPU_SOURCES,
    ),
    Accelerator(
      "v6e",
      32 * GiB,
      1,
      4,
      720 * GB,
      918e12,
      "tpu",
      int(31.25 * GiB),
      hbm_bandwidth_per_chip=1640 * GB,
      ici_bandwidth_per_chip=3584e9 / 8,
      dcn_bandwidth_per_chip=200e9 / 8 / 4,
      host_bandwidth_per_chip=32 * GB,
      bandwidth_sources=_TPU_SOURCES,
    ),
    # TPU7x (Ironwood): 192 GiB per chip exposed as two devices (one per
    # TensorCore) of 94.75 GiB each, 4 chips and 960 GB of RAM per VM; 2,307
    # dense bf16 TFLOP/s per chip (4,614 in fp8).
    Accelerator(
      "tpu7x",
      192 * GiB,
      2,
      4,
      960 * GB,
      2307e12,
      "tpu",
      int(94.75 * GiB),
      hbm_bandwidth_per_chip=7370 * GB,
      ici_bandwidth_per_chip=1200 * GB,
      dcn_bandwidth_per_chip=200e9 / 8 / 4,
      host_bandwidth_per_chip=32 * GB,
      bandwidth_sources=_TPU_SOURCES,
    ),
    # GPU nodes for the planner: 8 GPUs and (typically) 2 TB of RAM per node.
    Accelerator(
      "h100",
      80 * GiB,
      1,
      8,
      2000 * GB,
      989e12,
      "gpu",
      hbm_bandwidth_per_chip=3350 * GB,
      ici_bandwidth_per_chip=900 * GB,
      dcn_bandwidth_per_chip=400e9 / 8,
      host_bandwidth_per_chip=64 * GB,
      bandwidth_sources=_GPU_SOURCES,
    ),
    Accelerator(
      "h200",
      141 * GiB,
      1,
      8,
      2000 * GB,
      989e12,
      "gpu",
      hbm_bandwidth_per_chip=4800 * GB,
      ici_bandwidth_per_chip=900 * GB,
      dcn_bandwidth_per_chip=400e9 / 8,
      host_bandwidth_per_chip=64 * GB,
      bandwidth_sources=_GPU_SOURCES,
    ),
  )
}


@dataclasses.dataclass(frozen=True)
class Target:
  """A slice or node: an accelerator kind and how many chips."""

  accelerator: Accelerator
  chips: int

  @property
  def devices(self) -> int:
    return self.chips * self.accelerator.devices_per_chip

  @property
  def hosts(self) -> int:
    return max(1, math.ceil(self.chips / self.accelerator.chips_per_host))


def accelerator(name: str) -> Accelerator:
  """The table row of a kind ('v5p', 'tpu7x', 'h100', ...)."""
  kind = name.lower()
  if kind not in ACCELERATORS:
    raise ConfigError(f"unknown accelerator {name!r}; known: {', '.join(sorted(ACCELERATORS))}")
  return ACCELERATORS[kind]


def topology_accelerator(topology: str) -> Accelerator:
  """'v5p:4x4x4' -> the v5p row."""
  return accelerator(topology.split(":", 1)[0])


def topology_chips(topology: str) -> int:
  """'v5p:4x4x4' -> 64 chips."""
  try:
    _, dims = topology.split(":", 1)
    return math.prod(int(d) for d in dims.split("x"))
  except ValueError as err:
    raise ConfigError(
      f"topology {topology!r} is not '<kind>:<AxBxC>' (e.g. 'v5p:4x4x4', 'tpu7x:2x2x1')"
    ) from err


def parse_target(name: str) -> Target:
  """'v5p-64' (64 chips), 'tpu7x-64', 'h100x8' (8 GPUs) or a topology 'v5p:4x4x4'."""
  if ":" in name:
    return Target(topology_accelerator(name), topology_chips(name))
  m = re.fullmatch(r"([a-z0-9]+?)(?:-|x)(\d+)", name.lower())
  if not m:
    raise ConfigError(
      f"hardware {name!r} is not '<kind>-<chips>' (TPU, e.g. 'v5p-64') or "
      f"'<kind>x<gpus>' (GPU, e.g. 'h100x8'); known kinds: {', '.join(sorted(ACCELERATORS))}"
    )
  return Target(accelerator(m.group(1)), int(m.group(2)))


# `jax.Device.device_kind` strings (lower case) -> table rows. Longest match wins:
# 'tpu v5 lite' is a v5e, 'tpu v5' a v5p.
DEVICE_KINDS: dict[str, str] = {
  "tpu v5p": "v5p",
  "tpu v5 lite": "v5e",
  "tpu v5e": "v5e",
  "tpu v5": "v5p",
  "tpu v6 lite": "v6e",
  "tpu v6e": "v6e",
  "tpu7x": "tpu7x",
  "tpu7": "tpu7x",
  "nvidia h100": "h100",
  "nvidia h200": "h200",
}


def accelerator_of_device_kind(device_kind: str) -> Accelerator | None:
  """The table row of a `jax.Device.device_kind` ('TPU v5p', 'NVIDIA H100 80GB HBM3'),
  or None for kinds the table does not know (CPU)."""
  kind = device_kind.lower()
  for name in sorted(DEVICE_KINDS, key=len, reverse=True):
    if name in kind:
      return ACCELERATORS[DEVICE_KINDS[name]]
  return None


# The efficiency the step-time estimate assumes: the fraction of each lower
# bound a real step reaches (MaxText's long-context Llama-3.1-8B runs report 37-70%
# MFU; README "Will it fit?").
STEP_TIME_EFFICIENCY = 0.5
STEP_TIME_LABEL = (
  "estimate: the largest of FLOPs / peak, host bytes / PCIe and collective bytes / link "
  "bandwidth per device (a lower bound: no overlap loss, links at their data-sheet rate), "
  "divided by the stated efficiency"
)


def step_time(
  accel: Accelerator,
  *,
  flops: float,
  host_bytes: float = 0.0,
  ici_bytes: float = 0.0,
  dcn_bytes: float = 0.0,
  tokens_per_step: int = 0,
  peak_flops_per_device: float | None = None,
  efficiency: float = STEP_TIME_EFFICIENCY,
) -> dict:
  """Seconds one step takes per device, bounded by each resource (all per device).

  peak_flops_per_device: overrides the table's bf16 peak (the CPU's measured
  matmul). Returns each bound, `step_seconds_lower_bound` (their largest),
  `step_seconds_estimate` (that over `efficiency`) and `tokens_per_second_estimate`.
  """
  if not 0 < efficiency <= 1:
    raise ValueError(f"step-time efficiency must be in (0, 1]; got {efficiency}")
  d = accel.devices_per_chip
  peak = peak_flops_per_device or accel.peak_bf16_flops_per_chip / d

  def over(x: float, rate: float) -> float:
    return x / (rate / d) if x and rate else 0.0

  bounds = {
    "flops_seconds": flops / peak if peak else 0.0,
    "host_transfer_seconds": over(host_bytes, accel.host_bandwidth_per_chip),
    "ici_seconds": over(ici_bytes, accel.ici_bandwidth_per_chip),
    "dcn_seconds": over(dcn_bytes, accel.dcn_bandwidth_per_chip),
  }
  lower = max(bounds.values())
  estimate = lower / efficiency
  return {
    "step_time_bounds": bounds,
    "step_time_bound_by": max(bounds, key=bounds.get),
    "step_seconds_lower_bound": lower,
    "step_seconds_estimate": estimate,
    "step_time_efficiency": efficiency,
    "tokens_per_second_estimate": tokens_per_step / estimate if estimate else None,
    "peak_flops_per_device": peak,
    "step_time_label": STEP_TIME_LABEL,
  }
