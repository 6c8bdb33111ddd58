"""Plain-jnp attention that materialises the `[B, N, T, S]` scores.

The ground truth every kernel and parallel strategy is tested against. Memory is
quadratic in length: use it for tests and short sequences only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lctx.kernels.masking import (
  MASKED_LSE,
  check_shapes,
  default_scale,
  dense_mask,
  normalize_mask_args,
)


def reference_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  causal: bool = True,
  window_size: int | None = None,
  softmax_scale: float | None = None,
  return_lse: bool = False,
  block_q: int = 512,
  block_kv: int = 512,
  backend: str = "auto",
  block_q_bwd: int | None = None,
  block_kv_bwd: int | None = None,
):
  """Masked softmax attention, computed densely in float32.

  Args:
    q: `[B, T, N, H]`; k: `[B, S, K, H]`; v: `[B, S, K, V]`; N % K == 0, query head
      n uses kv head n // (N // K) (GQA/MQA by grouping, K/V are never copied).
    segment_ids: int32 `[B, T]` (needs T == S) or a `(q_ids [B, T], kv_ids [B, S])`
      pair; 0 marks padding. None: one segment, no padding.
    q_positions, kv_positions: int32 `[B, T]` / `[B, S]` (or unbatched); default
      arange. Causality and the window are decided on these.
    causal, window_size: see `lctx.kernels.masking`.
    softmax_scale: default 1/sqrt(H).
    return_lse: also return the log-sum-exp `[B, N, T]` float32.
    block_q, block_kv, backend, block_q_bwd, block_kv_bwd: accepted for
      signature compatibility; unused.

  Returns:
    out `[B, T, N, V]` in q.dtype (0 for rows that see no key), and lse `[B, N, T]`
    float32 (MASKED_LSE for rows that see no key) when return_lse.
  """
  del block_q, block_kv, backend, block_q_bwd, block_kv_bwd
  b, t, s, n, kh, h, vd = check_shapes(q, k, v)
  g = n // kh
  mask = normalize_mask_args(b, t, s, segment_ids, q_positions, kv_positions, window_size)
  vis = dense_mask(mask, causal, window_size)  # [B, T, S]
  scale = default_scale(h, softmax_scale)

  qg = q.astype(jnp.float32).reshape(b, t, kh, g, h)  # [B, T, K, G, H]
  scores = (
    jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    * scale
  )  # [B, K, G, T, S]
  vis_b = vis[:, None, None, :, :]
  scores = jnp.where(vis_b, scores, -jnp.inf)
  row_has_key = jnp.any(vis, axis=-1)[:, None, None, :]  # [B, 1, 1, T]
  # The row max only stabilises exp; softmax does not depend on it.
  m = jax.lax.stop_gradient(jnp.where(row_has_key, jnp.max(scores, axis=-1), 0.0))
  p = jnp.exp(scores - m[..., None])  # masked entries are exp(-inf) = 0
  l = jnp.sum(p, axis=-1)
  l_safe = jnp.where(row_has_key, l, 1.0)
  out = jnp.einsum(
    "BKGTS,BSKV->BTKGV",
    p / l_safe[..., None],
    v.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  out = out.reshape(b, t, n, vd).astype(q.dtype)
  if not return_lse:
    return out
  lse = jnp.where(row_has_key, m + jnp.log(l_safe), MASKED_LSE).reshape(b, n, t)
  return out, lse
