"""Ulysses (all-to-all) context parallelism, and usp (ulysses x ring).

Runs inside `jax.shard_map`. The all-to-all turns `[B, T/A, n, H]` (all local heads,
a sequence shard) into `[B, T, n/A, H]` (the whole sequence, a head group), the
kernel runs on the full sequence, and the inverse all-to-all restores the layout.
Head groups are contiguous, so q head i of a group still uses kv head i // G.
Composes with tensor parallelism: n is the heads left after tensor sharding.

usp: the all-to-all runs over `context_ulysses` (inside a ring group) and ring
attention over `context` (across groups) on the group's sequence chunk.

ContextOptions.head_chunks > 1 runs either one head group at a time (lctx/parallel/upipe.py).
"""

from __future__ import annotations

import jax

from lctx.kernels.options import AttentionOptions
from lctx.parallel import block_ops, upipe
from lctx.parallel.options import ContextOptions
from lctx.parallel.ring import ring_attention_local


def _to_heads(x, axis):
  """`[B, T/A, n, D]` -> `[B, T, n/A, D]`."""
  return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_seq(x, axis):
  """`[B, T, n/A, D]` -> `[B, T/A, n, D]`."""
  return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def _gather_tokens(x, axis):
  return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def ulysses_attention_local(
  q, k, v, seg, pos, *, cfg: AttentionOptions, ctx: ContextOptions, axis_name: str
):
  """Local q `[B, T/A, n, H]` ... -> out `[B, T/A, n, V]`."""
  if (ctx.head_chunks or 1) > 1:  # UPipe: one head group at a time
    seg, pos = _gather_tokens(seg, axis_name), _gather_tokens(pos, axis_name)
    return upipe.upipe_attention_local(
      q,
      k,
      v,
      seg,
      pos,
      stages=ctx.head_chunks,
      axis_name=axis_name,
      attend=upipe.ulysses_stage_attend(cfg, ctx),
    )
  q, k, v = (_to_heads(x, axis_name) for x in (q, k, v))
  seg, pos = _gather_tokens(seg, axis_name), _gather_tokens(pos, axis_name)
  layout = block_ops.token_layout(ctx, q.shape[1], 0, 0)  # the whole sequence
  out = block_ops.attend(
    q, k, v, q_seg=seg, kv_seg=seg, q_pos=pos, kv_pos=pos, cfg=cfg, layout=layout
  )
  return _to_seq(out, axis_name)


def usp_attention_local(
  q,
  k,
  v,
  seg,
  pos,
  *,
  cfg: AttentionOptions,
  ctx: ContextOptions,
  ring_axis: str,
  ring_size: int,
  ulysses_axis: str,
):
  """Local q `[B, T/(R*U), n, H]` ... -> out `[B, T/(R*U), n, V]`."""
  if (ctx.head_chunks or 1) > 1:  # UPipe: one head group at a time, each a ring
    seg, pos = _gather_tokens(seg, ulysses_axis), _gather_tokens(pos, ulysses_axis)

    def ring(q, k, v, seg, pos):
      return ring_attention_local(
        q, k, v, seg, pos, cfg=cfg, ctx=ctx, axis_name=ring_axis, axis_size=ring_size
      )

    return upipe.upipe_attention_local(
      q, k, v, seg, pos, stages=ctx.head_chunks, axis_name=ulysses_axis, attend=ring
    )
  q, k, v = (_to_heads(x, ulysses_axis) for x in (q, k, v))
  seg, pos = _gather_tokens(seg, ulysses_axis), _gather_tokens(pos, ulysses_axis)
  out = ring_attention_local(
    q, k, v, seg, pos, cfg=cfg, ctx=ctx, axis_name=ring_axis, axis_size=ring_size
  )
  return _to_seq(out, ulysses_axis)
