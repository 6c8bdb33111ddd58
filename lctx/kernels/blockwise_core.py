"""Block-sparse flash attention in pure JAX: online softmax, FA2 backward.

Layout (the thing that decides speed on XLA CPU): head-major blocks with the GQA
group folded into the query rows, so one block step is a K-batched matmul of
`[G*bq, H] x [H, bk]`. K/V are never repeated across the group. Einsum letters
(docs/contracts.md): X the G*bq rows of a query block, Y the bk keys of a KV block.

    q  [B, T, N, H] -> qb [B, nq, K, G*bq, H]     (rows ordered (g, t))
    k  [B, S, K, H] -> kb [B, nk, K, bk, H]
    v  [B, S, K, V] -> vb [B, nk, K, bk, V]

Per example, the forward scans over q blocks and, inside, loops only over the
live kv blocks of that q block (a compacted index list with a run-time trip
count; see block_map.py). Full blocks take a branch without the element mask.
The backward scans over kv blocks and loops over their live q blocks,
recomputing the probabilities from the saved lse (FlashAttention-2), with dq
accumulated in an O(T) buffer. Working set per step: O(G*bq*bk).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lctx.kernels import flop_tags
from lctx.kernels.block_map import block_map, block_stats, compact_lists
from lctx.kernels.masking import MASKED_LSE, visible
from lctx.kernels.shard_typing import varying_like

_F32 = jnp.float32


class Cfg(NamedTuple):
  """The kernel's settings for one call, resolved from its AttentionOptions
  (blockwise._setup): blocks clipped to the lengths, the scale, trip counts
  (hashable; custom_vjp nondiff argument)."""

  causal: bool
  window_size: int | None
  scale: float
  block_q: int
  block_kv: int
  count_blocks: bool = False  # debug: also return how many blocks were computed
  # Blocks of the backward pass, which holds ~2x the forward's per-step
  # temporaries (s, p, dp, ds); None: the forward's.
  bwd_block_q: int | None = None
  bwd_block_kv: int | None = None
  # Mean live kv blocks per q block (forward) and live q blocks per kv block
  # (backward), from the block map of the mask inputs known at trace time: the
  # run-time trip counts of the live-block loops, for FLOP counts (flop_tags.py).
  fwd_trips: float = 0.0
  bwd_trips: float = 0.0

  def for_backward(self) -> Cfg:
    return self._replace(
      block_q=self.bwd_block_q or self.block_q, block_kv=self.bwd_block_kv or self.block_kv
    )


class Blocked(NamedTuple):
  """One example's inputs in block layout (see module docstring)."""

  q_pos: jnp.ndarray  # [nq, bq]
  q_seg: jnp.ndarray | None  # [nq, bq]
  kv_pos: jnp.ndarray  # [nk, bk]
  kv_seg: jnp.ndarray | None  # [nk, bk]


def _elem_mask(cfg: Cfg, qp, qs, kp, ks):
  """Visibility `[bq, bk]` for one block pair (masking.visible)."""
  return visible(
    qp[:, None],
    None if qs is None else qs[:, None],
    kp[None, :],
    None if ks is None else ks[None, :],
    cfg.causal,
    cfg.window_size,
  )


def _scores(q_i, k_j):
  # [K, G*bq, H] x [K, bk, H] -> [K, G*bq, bk] float32
  return jnp.einsum("KXH,KYH->KXY", q_i, k_j, preferred_element_type=_F32)


def _apply_mask(s, vis, fill):
  """s `[K, G*bq, bk]`, vis `[bq, bk]` broadcast over K and G."""
  kh, rows, bk = s.shape
  bq = vis.shape[0]
  s = s.reshape(kh, rows // bq, bq, bk)
  s = jnp.where(vis[None, None], s, fill)
  return s.reshape(kh, rows, bk)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def forward_example(cfg: Cfg, qb, kb, vb, bl: Blocked):
  """One example. qb `[nq, K, R, H]` (R = G*bq, already scaled), kb `[nk, K, bk, H]`,
  vb `[nk, K, bk, V]`. Returns acc-normalised out `[nq, K, R, V]` f32, lse
  `[nq, K, R]` f32, and block counts `[2]` (computed, masked)."""
  _, kh, rows, _ = qb.shape
  vd = vb.shape[-1]
  live, full = block_map(
    block_stats(bl.q_pos, bl.q_seg), block_stats(bl.kv_pos, bl.kv_seg), cfg.causal, cfg.window_size
  )
  kv_order, kv_count = compact_lists(live)

  def q_block(_, xs):
    q_i, qp, qs, order, count, full_row = xs

    def kv_step(t, carry):
      m, l, acc, counts = carry
      j = order[t]
      k_j, v_j = kb[j], vb[j]

      def update(masked):
        s = _scores(q_i, k_j)
        if masked:
          vis = _elem_mask(cfg, qp, qs, bl.kv_pos[j], None if bl.kv_seg is None else bl.kv_seg[j])
          s = _apply_mask(s, vis, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l_new = l * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("KXY,KYV->KXV", p.astype(v_j.dtype), v_j, preferred_element_type=_F32)
        return m_new, l_new, acc * corr[..., None] + pv

      m, l, acc = jax.lax.cond(full_row[j], lambda: update(False), lambda: update(True))
      if cfg.count_blocks:
        counts = counts + jnp.stack([1, jnp.logical_not(full_row[j]).astype(jnp.int32)])
      return m, l, acc, counts

    # m starts finite so rows that never see a key give exp(-inf - m) = 0, not NaN.
    init = (
      jnp.full((kh, rows), MASKED_LSE, _F32),
      jnp.zeros((kh, rows), _F32),
      jnp.zeros((kh, rows, vd), _F32),
      jnp.zeros((2,), jnp.int32),
    )
    init = tuple(varying_like(x, q_i, kb, vb, *bl) for x in init)
    with flop_tags.trips_scope(cfg.fwd_trips):
      m, l, acc, counts = jax.lax.fori_loop(0, count, kv_step, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = acc / l_safe[..., None]
    lse = jnp.where(seen, m + jnp.log(l_safe), MASKED_LSE)
    return None, (out, lse, counts)

  # A None leaf (no segment ids) is an empty pytree: scan passes it through.
  xs = (qb, bl.q_pos, bl.q_seg, kv_order, kv_count, full)
  _, (out, lse, counts) = jax.lax.scan(q_block, None, xs)
  return out, lse, jnp.sum(counts, axis=0)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def backward_example(cfg: Cfg, qb, kb, vb, dob, lse, delta, bl: Blocked):
  """One example. qb `[nq, K, R, H]` (scaled), dob `[nq, K, R, V]`, lse and delta
  `[nq, K, R]` f32 (delta = rowsum(dout * out) - dlse). Returns dq `[nq, K, R, H]`
  (w.r.t. the scaled q), dk `[nk, K, bk, H]`, dv `[nk, K, bk, V]`, all f32."""
  live, full = block_map(
    block_stats(bl.q_pos, bl.q_seg), block_stats(bl.kv_pos, bl.kv_seg), cfg.causal, cfg.window_size
  )
  q_order, q_count = compact_lists(live.T)
  full_t = full.T

  def kv_block(dq, xs):
    k_j, v_j, kp, ks, order, count, full_col = xs

    def q_step(t, carry):
      dq, dk, dv = carry
      i = order[t]
      q_i, do_i, lse_i, delta_i = qb[i], dob[i], lse[i], delta[i]

      def grads(masked):
        s = _scores(q_i, k_j)
        if masked:
          vis = _elem_mask(cfg, bl.q_pos[i], None if bl.q_seg is None else bl.q_seg[i], kp, ks)
          s = _apply_mask(s, vis, -jnp.inf)
        p = jnp.exp(s - lse_i[..., None])  # [K, R, bk]
        # dK and dV are accumulated transposed ([K, H, bk]): the contraction
        # order XLA CPU runs fastest here (docs/benchmarks.md).
        dv_ij = jnp.einsum("KXV,KXY->KVY", do_i, p.astype(do_i.dtype), preferred_element_type=_F32)
        dp = jnp.einsum("KXV,KYV->KXY", do_i, v_j, preferred_element_type=_F32)
        ds = (p * (dp - delta_i[..., None])).astype(q_i.dtype)
        dq_i = jnp.einsum("KXY,KYH->KXH", ds, k_j, preferred_element_type=_F32)
        dk_ij = jnp.einsum("KXH,KXY->KHY", q_i, ds, preferred_element_type=_F32)
        return dq_i, dk_ij, dv_ij

      dq_i, dk_ij, dv_ij = jax.lax.cond(full_col[i], lambda: grads(False), lambda: grads(True))
      dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)
      return dq, dk + dk_ij, dv + dv_ij

    init = (
      dq,
      jnp.zeros(k_j.shape, _F32).swapaxes(1, 2),
      jnp.zeros(v_j.shape, _F32).swapaxes(1, 2),
    )
    init = (dq,) + tuple(varying_like(x, qb, kb, vb, dob, lse, delta, *bl) for x in init[1:])
    with flop_tags.trips_scope(cfg.bwd_trips):
      dq, dk_t, dv_t = jax.lax.fori_loop(0, count, q_step, init)
    return dq, (dk_t.swapaxes(1, 2), dv_t.swapaxes(1, 2))

  dq0 = varying_like(jnp.zeros(qb.shape, _F32), qb, kb, vb, dob, lse, delta, *bl)
  dq, (dk, dv) = jax.lax.scan(
    kv_block, dq0, (kb, vb, bl.kv_pos, bl.kv_seg, q_order, q_count, full_t)
  )
  return dq, dk, dv
