"""The attention pieces the strategies call, over `lctx.kernels`.

- `attend`: full differentiable attention (`lctx.kernels.flash_attention`): all_gather
  and ulysses use it.
- `block_forward` / `block_backward`: one (q block, kv block) step of the ring,
  returning (normalised out, lse) and FA2 gradients against a given global out/lse
  (`lctx.kernels.attention_block_forward` / `attention_block_backward`, which pick
  the kernel the same way flash_attention does).
- `maybe_visible`: conservative run-time test that a block pair has any visible
  (query, key) pair, used to skip fully masked ring steps.
- `token_layout`: where a call's rows sit in natural token order
  (`lctx.kernels.token_order.Layout`), built by the strategies from
  `ContextOptions.token_order`; kernels that mask on the natural index
  (splash) need it to take explicit positions, the others ignore it.

Every function takes the one `AttentionOptions` (`cfg`) and hands it on whole;
the ring's pieces and the token order come from `ContextOptions` (`ctx`).

Shapes: q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`, ids/positions `[B, T]`
/ `[B, S]` int32, lse `[B, N, T]` float32.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import lctx.kernels as kernels
from lctx.kernels.options import AttentionOptions
from lctx.kernels.token_order import Layout, TokenOrder
from lctx.parallel.options import ContextOptions

_BIG = 2**30


def ring_sub_chunks(ctx: ContextOptions, length: int) -> int:
  """How many pieces each device chunk of `length` tokens is cut into per hop."""
  if ctx.sub_chunks is not None:
    c = max(1, int(ctx.sub_chunks))
    return c if length % c == 0 else 1
  c = 1
  if length <= ctx.split_above:
    return c
  while length % (2 * c) == 0 and length // c > ctx.piece_tokens and 2 * c <= ctx.max_sub_chunks:
    c *= 2
  return c


def token_layout(ctx: ContextOptions, length: int, q_start, kv_start):
  """The kernels' Layout of a call whose q rows are global array indices
  q_start + [0, T) and kv rows kv_start + [0, S) of the `length`-token sequence
  (starts may be traced); None when ctx.token_order is None."""
  if ctx.token_order is None:
    return None
  return Layout(TokenOrder(int(length), int(ctx.token_order)), q_start, kv_start)


def attend(q, k, v, *, q_seg, kv_seg, q_pos, kv_pos, cfg: AttentionOptions, layout=None):
  """Differentiable attention of q against k/v; out `[B, T, N, V]`."""
  return kernels.flash_attention(
    q,
    k,
    v,
    segment_ids=(q_seg, kv_seg),
    q_positions=q_pos,
    kv_positions=kv_pos,
    options=cfg,
    layout=layout,
  )


def block_forward(q, k, v, *, q_seg, kv_seg, q_pos, kv_pos, cfg: AttentionOptions, layout=None):
  """One block step: (out `[B, T, N, V]` f32 normalised within the block, lse `[B, N, T]`)."""
  out, lse = kernels.attention_block_forward(
    q,
    k,
    v,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    q_positions=q_pos,
    kv_positions=kv_pos,
    options=cfg,
    layout=layout,
  )
  return out.astype(jnp.float32), lse.astype(jnp.float32)


def block_backward(
  q, k, v, out, lse, dout, *, q_seg, kv_seg, q_pos, kv_pos, cfg: AttentionOptions, layout=None
):
  """FA2 backward of one block against the GLOBAL out/lse; (dq, dk, dv) in float32."""
  dq, dk, dv = kernels.attention_block_backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    q_positions=q_pos,
    kv_positions=kv_pos,
    options=cfg,
    layout=layout,
  )
  return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def merge(o1, lse1, o2, lse2):
  """Combine two normalised partial results over disjoint key sets.

  o `[B, T, N, V]` f32, lse `[B, N, T]` f32; MASKED_LSE is finite so no NaN appears.
  """
  lse = jnp.logaddexp(lse1, lse2)
  w1 = jnp.exp(lse1 - lse).transpose(0, 2, 1)[..., None]  # [B, T, N, 1]
  w2 = jnp.exp(lse2 - lse).transpose(0, 2, 1)[..., None]
  return o1 * w1 + o2 * w2, lse


def maybe_visible(q_seg, kv_seg, q_pos, kv_pos, cfg: AttentionOptions, xp=jnp):
  """Scalar bool: False only if no (query, key) pair of the blocks can be visible.

  Conservative per row: a visible pair needs a shared non-zero segment id (so the
  id ranges overlap), kv_pos <= q_pos when causal (so min kv_pos <= max q_pos) and
  the window bounds. Works with numpy (xp=np) for block counting in benchmarks.
  """
  qv, kv = q_seg != 0, kv_seg != 0

  def lo(x, valid):
    return xp.min(xp.where(valid, x, _BIG), axis=1)

  def hi(x, valid):
    return xp.max(xp.where(valid, x, -_BIG), axis=1)

  ok = (lo(q_seg, qv) <= hi(kv_seg, kv)) & (lo(kv_seg, kv) <= hi(q_seg, qv))
  if cfg.causal:
    ok = ok & (lo(kv_pos, kv) <= hi(q_pos, qv))
  if cfg.window_size is not None:
    w = cfg.window_size
    ok = ok & (hi(kv_pos, kv) > lo(q_pos, qv) - w)
    if not cfg.causal:
      ok = ok & (lo(kv_pos, kv) < hi(q_pos, qv) + w)
  return xp.any(ok)


def count_ring_blocks(
  segment_ids, positions, *, ring_size: int, cfg: AttentionOptions, ctx: ContextOptions
):
  """Per-device number of (q sub-chunk, kv sub-chunk) pairs the ring computes.

  segment_ids, positions: numpy `[B, T]` in the order the ring sees (zigzag or not).
  Uses the same `maybe_visible` test as the ring, so it counts what it skips.
  Returns int array `[ring_size]`.
  """
  seg = np.asarray(segment_ids)
  pos = np.asarray(positions)
  seg_d = np.split(seg, ring_size, axis=1)
  pos_d = np.split(pos, ring_size, axis=1)
  c = ring_sub_chunks(ctx, seg_d[0].shape[1])
  counts = np.zeros(ring_size, dtype=np.int64)
  for r in range(ring_size):
    for step in range(ring_size):
      src = (r - step) % ring_size
      for qs, qp in zip(np.split(seg_d[r], c, 1), np.split(pos_d[r], c, 1)):
        for ks, kp in zip(np.split(seg_d[src], c, 1), np.split(pos_d[src], c, 1)):
          counts[r] += bool(maybe_visible(qs, ks, qp, kp, cfg, xp=np))
  return counts
