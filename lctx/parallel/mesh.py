"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes, in order: `data`, `fsdp`, `tensor`, `context`, `context_ulysses`.
`context` carries the ring (and plain ulysses / all_gather) part of context
parallelism; `context_ulysses` carries the all-to-all part of usp.

Models name logical axes only (`act_batch`, `embed`, ...); `LOGICAL_RULES` below
is the single place that says where each goes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lctx.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "context", "context_ulysses")
BATCH_AXES = ("data", "fsdp")
SEQ_AXES = ("context", "context_ulysses")

# Logical axis -> mesh axes. Activations are sequence-sharded over the context
# axes; parameters over fsdp (ZeRO-3) and tensor. Parameters are also sharded
# over the context axes: those devices would otherwise hold full replicas, and
# the per-layer all-gather is the same one FSDP already does.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  # activations
  ("act_batch", BATCH_AXES),
  ("act_seq", SEQ_AXES),
  ("act_embed", None),
  ("act_heads", "tensor"),
  ("act_kv_heads", "tensor"),
  ("act_head_dim", None),
  ("act_mlp", "tensor"),
  ("act_vocab", "tensor"),
  # parameters
  ("embed", ("fsdp", "context", "context_ulysses")),
  ("vocab", "tensor"),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("head_dim", None),
  ("q_lora", None),
  ("kv_lora", None),
  ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape. Exactly one axis may be -1: it takes the remaining devices.

  Attributes:
    data: data-parallel degree inside a slice (ICI).
    fsdp: parameter/optimizer sharding degree (ZeRO-3) inside a slice.
    tensor: tensor (head / MLP) parallel degree.
    context: context-parallel degree of the ring / all_gather / ulysses axis.
    context_ulysses: all-to-all degree for usp (1 otherwise).
    dcn_data: data-parallel degree across slices (DCN); multiplies `data`.
    dcn_fsdp: fsdp degree across slices (DCN); multiplies `fsdp`.
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  context: int = -1
  context_ulysses: int = 1
  dcn_data: int = 1
  dcn_fsdp: int = 1

  def ici_shape(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in MESH_AXES}


def resolve_mesh_shape(config: MeshConfig, num_devices: int) -> dict[str, int]:
  """Returns the full per-axis sizes (ICI x DCN), filling the one -1.

  Raises:
    ValueError: more than one -1, a size < 1, or sizes whose product does not
      match the device count.
  """
  dcn = {"data": config.dcn_data, "fsdp": config.dcn_fsdp}
  for name, size in dcn.items():
    if size < 1:
      raise ConfigError(f"mesh: dcn_{name}={size} must be >= 1.")
  dcn_total = math.prod(dcn.values())
  if num_devices % dcn_total:
    raise ConfigError(
      f"mesh: {num_devices} devices do not split into dcn_data x dcn_fsdp = {dcn_total} slices."
    )
  per_slice = num_devices // dcn_total
  shape = config.ici_shape()
  unknown = [a for a, s in shape.items() if s == -1]
  if len(unknown) > 1:
    raise ConfigError(f"mesh: only one axis may be -1, got -1 for {unknown} in {shape}.")
  bad = {a: s for a, s in shape.items() if s != -1 and s < 1}
  if bad:
    raise ConfigError(f"mesh: axis sizes must be >= 1 or -1, got {bad}.")
  known = math.prod(s for s in shape.values() if s != -1)
  if unknown:
    if per_slice % known:
      raise ConfigError(
        f"mesh: cannot fill axis '{unknown[0]}': {per_slice} devices per slice"
        f" are not divisible by the product {known} of the other axes "
        f"{ {a: s for a, s in shape.items() if s != -1} }."
      )
    shape[unknown[0]] = per_slice // known
  elif known != per_slice:
    raise ConfigError(
      f"mesh: axis sizes {shape} multiply to {known}, but there are "
      f"{per_slice} devices per slice ({num_devices} devices, "
      f"{dcn_total} slices)."
    )
  return {a: shape[a] * dcn.get(a, 1) for a in MESH_AXES}


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the 5-axis mesh; multi-slice (DCN) when dcn sizes exceed 1."""
  devices = list(jax.devices() if devices is None else devices)
  full = resolve_mesh_shape(config, len(devices))
  dcn_shape = [config.dcn_data, config.dcn_fsdp, 1, 1, 1]
  ici_shape = [full[a] // d for a, d in zip(MESH_AXES, dcn_shape)]
  if math.prod(dcn_shape) > 1:
    grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices=devices)
  else:
    try:
      grid = mesh_utils.create_device_mesh(ici_shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
      # Unusual topologies (e.g. fake CPU devices in odd shapes) fall back to
      # plain order; ICI locality does not matter there.
      grid = np.asarray(devices).reshape(ici_shape)
  return Mesh(grid, MESH_AXES)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.devices.shape))


def shard_map_over(fn, mesh, in_specs, out_specs):
  """`jax.shard_map(fn)` over the whole mesh (check_vma=True: every kernel and
  strategy types its loop carries and cotangents, lctx.kernels.shard_typing).

  On a concrete mesh with Explicit axes the arguments are first resharded to
  `in_specs`, which shard_map requires them to carry already."""
  mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
  explicit = isinstance(mesh, Mesh) and any(
    t == jax.sharding.AxisType.Explicit for t in mesh.axis_types
  )
  if not explicit:
    return mapped

  def run(*args):
    args = tuple(jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs))
    return mapped(*args)

  return run


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of `[batch, seq]` host batches: batch over data x fsdp, sequence
  over the context axes."""
  return NamedSharding(mesh, P(BATCH_AXES, SEQ_AXES))


def batch_shard_counts(mesh: Mesh) -> tuple[int, int]:
  """(batch ways, sequence ways) of `batch_sharding`."""
  shape = mesh_shape(mesh)
  return (math.prod(shape[a] for a in BATCH_AXES), math.prod(shape[a] for a in SEQ_AXES))
