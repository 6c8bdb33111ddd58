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
  (`lctx.kernels.splash.Layout`), built by the strategies from
  `AttnConfig.token_order`; kernels that mask on the natural index (splash) need
  it to take explicit positions, the others ignore it.

Shapes: q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`, ids/positions `[B, T]`
/ `[B, S]` int32, lse `[B, N, T]` float32.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import lctx.kernels as kernels

_BIG = 2**30


@dataclasses.dataclass(frozen=True)
class AttnConfig:
  """Static attention options shared by every strategy (hashable: nondiff arg)."""

  causal: bool = True
  window_size: int | None = None
  softmax_scale: float | None = None
  block_q: int = 512
  block_kv: int = 512
  backend: str = "auto"
  platform: str | None = None  # of the mesh devices: what "auto" picks for (None: default)
  block_q_bwd: int | None = None  # backward blocks of `attend` (None: the same)
  block_kv_bwd: int | None = None
  # Each ring hop can be split into sub_chunks x sub_chunks (q, kv) pairs that are
  # skipped independently and bound the kernel's per-call temporaries (layout
  # copies of q/k/v/out/dout scale with the call's length). None = auto: one call
  # per hop up to split_above tokens (8 heads x 64 f32 on CPU: 32K causal ring
  # fwd+bwd 76 s unsplit vs 116 s in 2048-token pieces, same run); above it,
  # pieces of <= piece_tokens, at most max_sub_chunks (pairs run in one fori_loop).
  # 16K-token chunks (128K on 8 devices) in 1/2/4/8 pieces: 418/385/341/325 MiB
  # temp with the pairs unrolled; 277 MiB at 8 pieces in the loop (2026-11-29).
  sub_chunks: int | None = None
  split_above: int = 4096
  piece_tokens: int = 2048
  max_sub_chunks: int = 8
  # The order of the global sequence the strategies shard, when the batch is known
  # to follow it (positions count up by one along the natural order inside every
  # segment, as the data pipeline makes them): 0 = natural order, P = zigzag over
  # ring size P (lctx.parallel.zigzag). None: unknown, so kernels that mask on the
  # natural token index (splash) do not apply and blockwise runs instead.
  token_order: int | None = None
  # ulysses / usp: run the all-to-all attention in this many head stages (UPipe,
  # lctx/parallel/upipe.py); None or 1: all heads at once.
  head_chunks: int | None = None

  def scale(self, head_dim: int) -> float:
    return head_dim**-0.5 if self.softmax_scale is None else float(self.softmax_scale)


def ring_sub_chunks(cfg: AttnConfig, length: int) -> int:
  """How many pieces each device chunk of `length` tokens is cut into per hop."""
  if cfg.sub_chunks is not None:
    c = max(1, int(cfg.sub_chunks))
    return c if length % c == 0 else 1
  c = 1
  if length <= cfg.split_above:
    return c
  while length % (2 * c) == 0 and length // c > cfg.piece_tokens and 2 * c <= cfg.max_sub_chunks:
    c *= 2
  return c


def token_layout(cfg: AttnConfig, length: int, q_start, kv_start):
  """The kernels' Layout of a call whose q rows are global array indices
  q_start + [0, T) and kv rows kv_start + [0, S) of the `length`-token sequence
  (starts may be traced); None when cfg.token_order is None."""
  if cfg.token_order is None:
    return None
  order = kernels.splash.TokenOrder(int(length), int(cfg.token_order))
  return kernels.splash.Layout(order, q_start, kv_start)


def attend(q, k, v, *, q_seg, kv_seg, q_pos, kv_pos, cfg: AttnConfig, layout=None):
  """Differentiable attention of q against k/v; out `[B, T, N, V]`."""
  return kernels.flash_attention(
    q,
    k,
    v,
    segment_ids=(q_seg, kv_seg),
    q_positions=q_pos,
    kv_positions=kv_pos,
    causal=cfg.causal,
    window_size=cfg.window_size,
    softmax_scale=cfg.softmax_scale,
    block_q=cfg.block_q,
    block_kv=cfg.block_kv,
    backend=cfg.backend,
    block_q_bwd=cfg.block_q_bwd,
    block_kv_bwd=cfg.block_kv_bwd,
    platform=cfg.platform,
    layout=layout,
  )


def block_forward(q, k, v, *, q_seg, kv_seg, q_pos, kv_pos, cfg: AttnConfig, layout=None):
  """One block step: (out `[B, T, N, V]` f32 normalised within the block, lse `[B, N, T]`)."""
  out, lse = kernels.attention_block_forward(
    q,
    k,
    v,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    q_positions=q_pos,
    kv_positions=kv_pos,
    causal=cfg.causal,
    window_size=cfg.window_size,
    softmax_scale=cfg.softmax_scale,
    block_q=cfg.block_q,
    block_kv=cfg.block_kv,
    backend=cfg.backend,
    platform=cfg.platform,
    layout=layout,
  )
  return out.astype(jnp.float32), lse.astype(jnp.float32)


def block_backward(
  q, k, v, out, lse, dout, *, q_seg, kv_seg, q_pos, kv_pos, cfg: AttnConfig, layout=None
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
    causal=cfg.causal,
    window_size=cfg.window_size,
    softmax_scale=cfg.softmax_scale,
    block_q=cfg.block_q,
    block_kv=cfg.block_kv,
    backend=cfg.backend,
    platform=cfg.platform,
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


def maybe_visible(q_seg, kv_seg, q_pos, kv_pos, cfg: AttnConfig, xp=jnp):
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


def count_ring_blocks(segment_ids, positions, *, ring_size: int, cfg: AttnConfig):
  """Per-device number of (q sub-chunk, kv sub-chunk) pairs the ring computes.

  segment_ids, positions: numpy `[B, T]` in the order the ring sees (zigzag or not).
  Uses the same `maybe_visible` test as the ring, so it counts what it skips.
  Returns int array `[ring_size]`.
  """
  seg = np.asarray(segment_ids)
  pos = np.asarray(positions)
  seg_d = np.split(seg, ring_size, axis=1)
  pos_d = np.split(pos, ring_size, axis=1)
  c = ring_sub_chunks(cfg, seg_d[0].shape[1])
  counts = np.zeros(ring_size, dtype=np.int64)
  for r in range(ring_size):
    for step in range(ring_size):
      src = (r - step) % ring_size
      for qs, qp in zip(np.split(seg_d[r], c, 1), np.split(pos_d[r], c, 1)):
        for ks, kp in zip(np.split(seg_d[src], c, 1), np.split(pos_d[src], c, 1)):
          counts[r] += bool(maybe_visible(qs, ks, qp, kp, cfg, xp=np))
  return counts
