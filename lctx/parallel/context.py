"""Public entry of context parallelism: strategy dispatch over the whole mesh.

- `context_attention(q, k, v, *, mesh, strategy, ...)`: global arrays in natural
  token order in, natural order out (does the zigzag reorder itself when
  load_balance=True). Callable inside or outside jit; differentiable.
- `make_attention_fn(mesh, strategy, ...)`: the model plug-in (docs/contracts.md)
  for the train step, on batches the pipeline has ALREADY put in zigzag order.

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
from lctx.kernels.options import AttentionOptions, options_from
from lctx.kernels.remat_tags import TAGS_ATTRIBUTE
from lctx.parallel.all_gather import all_gather_attention_local
from lctx.parallel.auto import AttentionDims, choose_strategy, decide_strategy
from lctx.parallel.mesh import BATCH_AXES, LOGICAL_RULES, SEQ_AXES, mesh_shape, shard_map_over
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

__all__ = [
  "STRATEGIES",
  "choose_strategy",
  "context_attention",
  "default_load_balance",
  "make_attention_fn",
  "validate_context_parallel",
  "zigzag_inverse",
  "zigzag_reorder",
  "zigzag_ring_size",
]


def _present(mesh, axes):
  names = tuple(a for a in axes if a in mesh.axis_names)
  return names or None


def _local_fn(strategy: str, mesh, cfg: AttentionOptions):
  shape = mesh_shape(mesh)
  if strategy == "all_gather":
    return functools.partial(
      all_gather_attention_local, cfg=cfg, axis_names=_present(mesh, SEQ_AXES) or ()
    )
  if strategy == "ulysses":
    return functools.partial(ulysses_attention_local, cfg=cfg, axis_name="context")
  if strategy == "ring":
    return functools.partial(
      ring_attention_local, cfg=cfg, axis_name="context", axis_size=shape["context"]
    )
  if strategy == "usp":
    return functools.partial(
      usp_attention_local,
      cfg=cfg,
      ring_axis="context",
      ring_size=shape["context"],
      ulysses_axis="context_ulysses",
    )
  raise ConfigError(f"[unknown-strategy] {strategy!r} is not one of {STRATEGIES}")


@functools.cache
def _sharded(mesh, strategy: str, cfg: AttentionOptions, kv_heads_sharded: bool):
  """jit(shard_map(strategy)) over the whole mesh; cached per configuration."""
  batch, seq = _present(mesh, BATCH_AXES), _present(mesh, SEQ_AXES)
  head = HEAD_AXIS if HEAD_AXIS in mesh.axis_names else None
  q_spec = P(batch, seq, head, None)
  kv_spec = P(batch, seq, head if kv_heads_sharded else None, None)
  tok_spec = P(batch, seq)
  specs = (q_spec, kv_spec, kv_spec, tok_spec, tok_spec)
  return jax.jit(shard_map_over(_local_fn(strategy, mesh, cfg), mesh, specs, q_spec))


def _apply(mesh, strategy, cfg, q, k, v, segment_ids, positions):
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
  return _sharded(mesh, strategy, cfg, kv_sharded)(q, k, v, segment_ids, positions)


def make_attention_fn(
  mesh,
  strategy: str,
  *,
  kernel_backend: str = "auto",
  block_q: int = 512,
  block_kv: int = 512,
  sub_chunks: int | None = None,
  load_balance: bool | None = None,
  block_q_bwd: int | None = None,
  block_kv_bwd: int | None = None,
  platform: str | None = None,
  ulysses_head_chunks: int | None = None,
  stage_projections: bool = False,
  options: AttentionOptions | None = None,
):
  """Builds the model's attention plug-in for one resolved strategy.

  The batch it sees must already be in the order the pipeline produced (zigzag
  when load balancing); positions carry the true positions, so masks are right in
  either order. `load_balance` feeds validation (None: not checked) and tells the
  kernels the batch's token order (zigzag or natural; None: unknown), so that
  splash, which masks on the natural token index, can take the calls: it relies
  on positions counting up by one along the natural order inside every segment,
  as the data pipeline makes them (other positions: kernel_backend='blockwise').
  `options`: the attention options (the plan's); or the keywords kernel_backend
  (its `backend`), block_q, block_kv, block_q_bwd, block_kv_bwd, sub_chunks and
  platform (not both). A platform of None means the mesh devices'.
  `ulysses_head_chunks` (ulysses / usp): run attention in this many head stages
  (UPipe, lctx/parallel/upipe.py); None or 1: all heads at once.
  `stage_projections` (with ulysses_head_chunks > 1): the plug-in runs every
  head at once but carries `head_stages(num_heads, num_kv_heads)` (upipe.
  head_stages): the model then projects q/k/v and the output one stage at a
  time and calls the plug-in per stage (lctx/models/attention.py), so the
  layer's whole q, attention output and their gradients never exist; K/V are
  re-projected and re-exchanged per q stage.
  Validation runs at trace time, before anything compiles.
  """
  base = options_from(
    options,
    backend=kernel_backend,
    block_q=block_q,
    block_kv=block_kv,
    sub_chunks=sub_chunks,
    block_q_bwd=block_q_bwd,
    block_kv_bwd=block_kv_bwd,
    platform=platform,
  )
  if strategy not in STRATEGIES:
    raise ConfigError(
      f"[unknown-strategy] context_parallel_strategy {strategy!r} is not "
      f"one of {STRATEGIES}; resolve 'auto' with choose_strategy first"
    )
  if (ulysses_head_chunks or 1) > 1 and strategy not in ("ulysses", "usp"):
    raise ConfigError(
      f"[head-chunks] ulysses_head_chunks={ulysses_head_chunks} applies to the ulysses "
      f"and usp strategies only, not {strategy!r}"
    )
  base = dataclasses.replace(
    base,
    platform=base.platform or mesh.devices.flat[0].platform,
    token_order=None
    if load_balance is None
    else (zigzag_ring_size(mesh_shape(mesh)) if load_balance else 0),
    head_chunks=None if stage_projections else ulysses_head_chunks,
  )

  def attention_fn(
    q, k, v, *, segment_ids=None, positions=None, causal=True, window_size=None, softmax_scale=None
  ):
    validate_context_parallel(
      strategy=strategy,
      mesh_shape=mesh_shape(mesh),
      num_q_heads=q.shape[2],
      num_kv_heads=k.shape[2],
      seq_len=q.shape[1],
      load_balance=bool(load_balance),
    )
    cfg = base.with_mask(causal, window_size, softmax_scale)
    return _apply(mesh, strategy, cfg, q, k, v, segment_ids, positions)

  # Every call goes through lctx.kernels' custom VJPs (or the ring's), which tag
  # their output and lse for the remat policies (lctx/kernels/remat_tags.py).
  setattr(attention_fn, TAGS_ATTRIBUTE, True)
  if stage_projections:
    if (ulysses_head_chunks or 1) < 2:
      raise ConfigError(
        "[head-chunks] ulysses_stage_projections needs ulysses_head_chunks >= 2, got "
        f"{ulysses_head_chunks}"
      )
    if mesh_shape(mesh).get("tensor", 1) > 1:
      raise ConfigError(
        "[head-chunks] ulysses_stage_projections picks global heads per stage, so it "
        f"needs tensor = 1; got mesh {mesh_shape(mesh)} (use ulysses_head_chunks alone)"
      )
    degree = mesh_shape(mesh).get("context" if strategy == "ulysses" else "context_ulysses", 1)
    attention_fn.head_stages = functools.partial(
      head_stages, degree=degree, stages=ulysses_head_chunks
    )
  return attention_fn


def context_attention(
  q,
  k,
  v,
  *,
  mesh,
  strategy: str,
  segment_ids=None,
  causal=True,
  load_balance: bool = False,
  window_size=None,
  softmax_scale=None,
  positions=None,
  kernel_backend: str = "auto",
  block_q: int = 512,
  block_kv: int = 512,
  ulysses_head_chunks: int | None = None,
  options: AttentionOptions | None = None,
):
  """Context-parallel attention on global arrays in natural token order.

  Args:
    q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K, V]`; segment_ids `[B, T]` (0 =
    padding; None: one segment); positions `[B, T]` (None: arange), counting up
    by one inside every segment (the pipeline's; splash masks on that order).
    strategy: 'all_gather' | 'ulysses' | 'ring' | 'usp' | 'auto'.
    load_balance: zigzag-reorder with ring size = context before, and undo it
      after (the training path instead gets pre-reordered batches).
    ulysses_head_chunks: ulysses / usp head stages (UPipe; see make_attention_fn).
    options: the kernel settings as one AttentionOptions, instead of
      kernel_backend / block_q / block_kv (the mask stays in causal,
      window_size and softmax_scale).
  Returns:
    out `[B, T, N, V]` in natural order.
  """
  shape = mesh_shape(mesh)
  b, t, n, h = q.shape
  if strategy == "auto":
    dims = AttentionDims(n, k.shape[2], h, v.shape[3], bytes_per_element=q.dtype.itemsize)
    strategy, _ = decide_strategy(
      "auto",
      mesh_shape=shape,
      platform=mesh.devices.flat[0].platform,
      dims=dims,
      seq_len=t,
      batch_size=b,
      load_balance=load_balance,
    )
  validate_context_parallel(
    strategy=strategy,
    mesh_shape=shape,
    num_q_heads=n,
    num_kv_heads=k.shape[2],
    seq_len=t,
    load_balance=load_balance,
  )
  fn = make_attention_fn(
    mesh,
    strategy,
    kernel_backend=kernel_backend,
    block_q=block_q,
    block_kv=block_kv,
    load_balance=load_balance,
    ulysses_head_chunks=ulysses_head_chunks,
    options=options,
  )
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  segment_ids = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, t))
  if not load_balance:
    return fn(
      q,
      k,
      v,
      segment_ids=segment_ids,
      positions=positions,
      causal=causal,
      window_size=window_size,
      softmax_scale=softmax_scale,
    )
  ring = zigzag_ring_size(shape)
  rows = shape.get("data", 1) * shape.get("fsdp", 1)
  if b % rows:
    raise ConfigError(f"[batch-divisible] batch ({b}) must be divisible by data x fsdp = {rows}")
  # Collective permutes of each device's two half-shards (lctx.parallel.zigzag):
  # no device ever holds more than its shard, unlike a gather of the sequence.
  q, k, v, segment_ids, positions = (
    _zigzag_sharded(x, mesh, ring) for x in (q, k, v, segment_ids, positions)
  )
  out = fn(
    q,
    k,
    v,
    segment_ids=segment_ids,
    positions=positions,
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
  )
  return _zigzag_sharded(out, mesh, ring, inverse=True)


def _zigzag_sharded(x, mesh, ring: int, inverse: bool = False):
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
