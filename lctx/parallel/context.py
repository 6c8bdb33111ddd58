"""Public entry of context parallelism: strategy dispatch over the whole mesh.

- `make_attention_fn(mesh, context, options)`: the attention call of the model's
  mixer (docs/contracts.md) on batches the pipeline has ALREADY put in zigzag
  order; `stage_heads` UPipe's per-stage heads. The run's `ContextPlan`
  (plan.py) builds both, and `context_attention` (plan.py) runs a plan on
  natural-order global arrays.
- `zigzag_sharded`: natural <-> zigzag order of a sharded global array.

Layout inside `jax.shard_map`: batch over (data, fsdp), sequence over
(context, context_ulysses), heads over tensor (kv heads replicated over tensor
for MQA). Axes absent from the mesh are simply not used.
Shapes: q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K, V]`, segment_ids and
positions `[B, T]` int32, out `[B, T, N, V]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lctx.errors import ConfigError
from lctx.kernels.options import AttentionOptions
from lctx.kernels.remat_tags import TAGS_ATTRIBUTE
from lctx.parallel import halo
from lctx.parallel.all_gather import all_gather_attention_local
from lctx.parallel.auto import choose_strategy
from lctx.parallel.mesh import BATCH_AXES, LOGICAL_RULES, SEQ_AXES, mesh_shape, shard_map_over
from lctx.parallel.options import ContextOptions
from lctx.parallel.ring import ring_attention_local
from lctx.parallel.ulysses import ulysses_attention_local, usp_attention_local
from lctx.parallel.upipe import head_stages
from lctx.parallel.validation import (
  STRATEGIES,
  default_load_balance,
  validate_context_parallel,
  zigzag_ring_size,
)
from lctx.parallel.zigzag import zigzag_inverse, zigzag_permute_local, zigzag_reorder

# Where shard_map splits q/k/v: the mesh axes LOGICAL_RULES gives the activations.
HEAD_AXIS = dict(LOGICAL_RULES)["act_heads"]
_DEFAULT_OPTIONS = AttentionOptions()

__all__ = [
  "STRATEGIES",
  "choose_strategy",
  "default_load_balance",
  "make_attention_fn",
  "stage_heads",
  "validate_context_parallel",
  "zigzag_inverse",
  "zigzag_reorder",
  "zigzag_ring_size",
]


def _present(mesh, axes):
  names = tuple(a for a in axes if a in mesh.axis_names)
  return names or None


def _local_fn(mesh, cfg: AttentionOptions, ctx: ContextOptions, window_aware: bool = False):
  plain = _plain_local_fn(mesh, cfg, ctx)
  if not window_aware or cfg.window_size is None or ctx.token_order is None:
    return plain
  return _window_aware_fn(mesh, cfg, ctx, plain)


def _window_aware_fn(mesh, cfg: AttentionOptions, ctx: ContextOptions, plain):
  """A sliding layer's local call (lctx/parallel/halo.py): ring, all_gather and
  usp exchange only the halo the window needs; ulysses already runs the
  windowed kernel on whole sequences after its all-to-all."""
  shape = mesh_shape(mesh)
  zigzag = bool(ctx.token_order)
  if ctx.strategy == "ring":
    return halo.window_aware(
      plain, cfg=cfg, ctx=ctx, axis_names="context", axis_size=shape["context"], zigzag=zigzag
    )
  if ctx.strategy == "usp":
    return halo.usp_window_aware(
      plain,
      cfg=cfg,
      ctx=ctx,
      ring_axis="context",
      ring_size=shape["context"],
      ulysses_axis="context_ulysses",
      ulysses_size=shape.get("context_ulysses", 1),
      zigzag=zigzag,
    )
  if ctx.strategy == "all_gather":
    axes = _present(mesh, SEQ_AXES) or ()
    ways = 1
    for a in axes:
      ways *= shape[a]
    if zigzag and ways != ctx.token_order:  # zigzag pieces split over more axes
      return plain
    return halo.window_aware(
      plain, cfg=cfg, ctx=ctx, axis_names=axes, axis_size=ways, zigzag=zigzag
    )
  return plain


def _plain_local_fn(mesh, cfg: AttentionOptions, ctx: ContextOptions):
  shape = mesh_shape(mesh)
  strategy = ctx.strategy
  if strategy == "all_gather":
    return functools.partial(
      all_gather_attention_local, cfg=cfg, ctx=ctx, axis_names=_present(mesh, SEQ_AXES) or ()
    )
  if strategy == "ulysses":
    return functools.partial(ulysses_attention_local, cfg=cfg, ctx=ctx, axis_name="context")
  if strategy == "ring":
    return functools.partial(
      ring_attention_local, cfg=cfg, ctx=ctx, axis_name="context", axis_size=shape["context"]
    )
  if strategy == "usp":
    return functools.partial(
      usp_attention_local,
      cfg=cfg,
      ctx=ctx,
      ring_axis="context",
      ring_size=shape["context"],
      ulysses_axis="context_ulysses",
    )
  raise ConfigError(f"[unknown-strategy] {strategy!r} is not one of {STRATEGIES}")


@functools.cache
def _sharded(
  mesh,
  cfg: AttentionOptions,
  ctx: ContextOptions,
  kv_heads_sharded: bool,
  window_aware: bool = False,
):
  """jit(shard_map(strategy)) over the whole mesh; cached per configuration."""
  batch, seq = _present(mesh, BATCH_AXES), _present(mesh, SEQ_AXES)
  head = HEAD_AXIS if HEAD_AXIS in mesh.axis_names else None
  q_spec = P(batch, seq, head, None)
  kv_spec = P(batch, seq, head if kv_heads_sharded else None, None)
  tok_spec = P(batch, seq)
  specs = (q_spec, kv_spec, kv_spec, tok_spec, tok_spec)
  local = _local_fn(mesh, cfg, ctx, window_aware)
  return jax.jit(shard_map_over(local, mesh, specs, q_spec))


def _apply(mesh, cfg, ctx, q, k, v, segment_ids, positions, window_aware=False):
  b, t = q.shape[:2]
  shape = mesh_shape(mesh)
  rows = shape.get("data", 1) * shape.get("fsdp", 1)
  if b % rows != 0:
    raise ConfigError(f"[batch-divisible] batch ({b}) must be divisible by data x fsdp = {rows}")
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  segment_ids = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, t))
  kh = k.shape[2]
  kv_sharded = kh % shape.get(HEAD_AXIS, 1) == 0
  return _sharded(mesh, cfg, ctx, kv_sharded, window_aware)(q, k, v, segment_ids, positions)


def make_attention_fn(
  mesh,
  context: ContextOptions,
  options: AttentionOptions = _DEFAULT_OPTIONS,
  *,
  validated_seq_len: int | None = None,
  window_aware: bool = False,
):
  """Builds the attention call of one resolved strategy (the mixer's `attention`).

  context: `strategy` resolved (one of STRATEGIES, not 'auto'); `token_order`
  the batch's token order (the plan sets it: zigzag over the ring when load
  balancing, else natural; None: unknown, then splash, which masks on the
  natural token index, does not take calls with positions); `head_chunks`
  (ulysses / usp) the head stages the call runs (UPipe, lctx/parallel/upipe.py;
  with `stage_projections` the model stages the heads and each call runs its
  heads at once: `stage_heads`); `load_balance` feeds validation.
  options: the kernel settings; a platform of None means the mesh devices'.

  The batch it sees must already be in the order the pipeline produced (zigzag
  when load balancing); positions carry the true positions, so masks are right in
  either order. The rules of strategy, mesh and heads are checked where the plan
  is made (`make_context_plan`); a call checks them once per new (heads, length)
  shape, so the eval grid's other lengths are checked too, and a plan's own
  shape (`validated_seq_len`) is not checked twice.
  `window_aware` (the mixer's `sliding_attention`): calls with a causal window
  exchange only the keys the window reaches (lctx/parallel/halo.py) under ring,
  all_gather and usp, when the batch's token order is known.
  """
  strategy = context.strategy
  if strategy not in STRATEGIES:
    raise ConfigError(
      f"[unknown-strategy] context_parallel_strategy {strategy!r} is not "
      f"one of {STRATEGIES}; resolve 'auto' with make_context_plan first"
    )
  chunks = context.call_head_chunks
  if (chunks or 1) > 1 and strategy not in ("ulysses", "usp"):
    raise ConfigError(
      f"[head-chunks] ContextOptions.head_chunks={chunks} applies to the ulysses "
      f"and usp strategies only, not {strategy!r}"
    )
  ctx = dataclasses.replace(context, head_chunks=chunks, stage_projections=False)
  base = dataclasses.replace(options, platform=options.platform or mesh.devices.flat[0].platform)
  checked = set()

  def attention_fn(
    q, k, v, *, segment_ids=None, positions=None, causal=True, window_size=None, softmax_scale=None
  ):
    shape = (q.shape[2], k.shape[2], q.shape[1])
    if shape not in checked and q.shape[1] != validated_seq_len:
      validate_context_parallel(
        strategy=strategy,
        mesh_shape=mesh_shape(mesh),
        num_q_heads=q.shape[2],
        num_kv_heads=k.shape[2],
        seq_len=q.shape[1],
        load_balance=bool(ctx.load_balance),
      )
    checked.add(shape)
    cfg = base.with_mask(causal, window_size, softmax_scale)
    return _apply(mesh, cfg, ctx, q, k, v, segment_ids, positions, window_aware)

  # Every call goes through lctx.kernels' custom VJPs (or the ring's), which tag
  # their output and lse for the remat policies (lctx/kernels/remat_tags.py).
  setattr(attention_fn, TAGS_ATTRIBUTE, True)
  return attention_fn


def stage_heads(mesh, strategy: str, head_chunks: int | None):
  """UPipe with per-stage projections (ContextOptions.stage_projections): the
  mixer's `head_stages(num_heads, num_kv_heads) -> (q_heads [S, N/S], kv_heads [S, M])`
  (upipe.head_stages). The attention call then runs every head it is given at once,
  and the model projects q/k/v and the output one stage at a time."""
  if strategy not in ("ulysses", "usp", "ring"):
    raise ConfigError(
      f"[head-chunks] ContextOptions.stage_projections stages the heads of ulysses, usp or "
      f"ring; strategy {strategy!r} takes every head at once"
    )
  if (head_chunks or 1) < 2:
    raise ConfigError(
      f"[head-chunks] ContextOptions.stage_projections needs head_chunks >= 2, got {head_chunks}"
    )
  shape = mesh_shape(mesh)
  if shape.get("tensor", 1) > 1:
    raise ConfigError(
      "[head-chunks] ContextOptions.stage_projections picks global heads per stage, so it "
      f"needs tensor = 1; got mesh {shape} (use head_chunks alone)"
    )
  # Ring has no all-to-all: each stage is its own heads' ring (degree 1), which
  # keeps a stage's traveling K/V and their float32 gradients to its kv heads.
  degree = {"ulysses": "context", "usp": "context_ulysses"}.get(strategy)
  degree = shape.get(degree, 1) if degree else 1
  return functools.partial(head_stages, degree=degree, stages=head_chunks)


def zigzag_sharded(x, mesh, ring: int, inverse: bool = False):
  """Natural -> zigzag order (inverse: back) along axis 1 of a global array
  sharded like the strategies' inputs: batch over (data, fsdp), sequence over
  the context axes, heads (axis 2 of rank-4 arrays) over tensor where they divide."""
  batch, seq = _present(mesh, BATCH_AXES), _present(mesh, SEQ_AXES)
  if seq is None:
    return (zigzag_inverse if inverse else zigzag_reorder)(x, ring, axis=1)
  shape = mesh_shape(mesh)
  ways = 1
  for a in seq:
    ways *= shape[a]
  rest = [None] * (x.ndim - 2)
  if x.ndim == 4 and HEAD_AXIS in shape and x.shape[2] % shape[HEAD_AXIS] == 0:
    rest[0] = HEAD_AXIS
  spec = P(batch, seq, *rest)
  local = functools.partial(
    zigzag_permute_local, ring_size=ring, axis_names=seq, ways=ways, inverse=inverse
  )
  fn = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    # Explicit axes: in and out in the caller's sharding (cotangents arrive in it).
    given = jax.typeof(x).sharding
    given = NamedSharding(mesh, given.spec if given.mesh.axis_names else P())
    return jax.sharding.reshard(fn(jax.sharding.reshard(x, NamedSharding(mesh, spec))), given)
  return fn(x)
