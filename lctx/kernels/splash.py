"""TPU splash attention (Pallas), the TPU backend of `lctx.kernels.flash_attention`.

Built on `jax.experimental.pallas.ops.tpu.splash_attention`: block-sparse, with a
static block map (fully masked blocks are never computed) and segment ids for
packed rows. Masks here follow array order, so a call qualifies only with default
positions (or positions_in_order=True) and without lse. On the CPU backend the
same kernel runs through the Pallas interpreter (interpret=True), so its
semantics can be tested anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lctx.kernels.masking import check_shapes, default_scale, normalize_mask_args


def unsupported(q, k, v, positions_given: bool, return_lse: bool) -> str:
  """Why these inputs cannot take the splash kernel ('' if they can)."""
  _, t, s, _, _, h, vd = check_shapes(q, k, v)
  if return_lse:
    return "splash here does not return lse (return_lse=True)"
  if positions_given:
    return "splash masks on array order; explicit positions need positions_in_order=True"
  if t % 128 or s % 128:
    return f"splash needs q_len and kv_len multiples of 128 (got {t}, {s})"
  if h != vd:
    return f"splash needs equal q/k and v head dims (got {h}, {vd})"
  return ""


def _zero_padding_rows(out, segment_ids):
  """Rows with segment id 0 see nothing: output 0 (kernels that mask by segment
  equality alone let padding attend to padding)."""
  if segment_ids is None:
    return out
  q_seg = segment_ids[0] if isinstance(segment_ids, (tuple, list)) else segment_ids
  q_seg = jnp.broadcast_to(jnp.asarray(q_seg).reshape((-1, out.shape[1])), out.shape[:2])
  return jnp.where((q_seg != 0)[:, :, None, None], out, jnp.zeros_like(out))


def splash_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  causal=True,
  window_size=None,
  softmax_scale=None,
  block_q=512,
  block_kv=512,
  block_q_bwd=None,
  block_kv_bwd=None,
  interpret=False,
):
  """TPU splash attention. q `[B, T, N, H]`, k/v `[B, S, K, H]`; masks by array
  order (default positions). GQA runs the MQA kernel per kv head (no K/V copy)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # TPU-only deps
    splash_attention_kernel as sk,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as sm,
  )

  b, t, s, n, kh, h, _ = check_shapes(q, k, v)
  g = n // kh
  scale = default_scale(h, softmax_scale)
  if window_size is not None:
    w = int(window_size) - 1
    base = sm.LocalMask((t, s), window_size=(w, 0 if causal else w), offset=0)
  elif causal:
    base = sm.CausalMask((t, s))
  else:
    base = sm.FullMask((t, s))
  bq, bk = min(block_q, t), min(block_kv, s)
  gq, gk = min(block_q_bwd or block_q, t), min(block_kv_bwd or block_kv, s)
  sizes = sk.BlockSizes(
    block_q=bq,
    block_kv=bk,
    block_kv_compute=bk,
    block_q_dkv=gq,
    block_kv_dkv=gk,
    block_kv_dkv_compute=gk,
    block_q_dq=gq,
    block_kv_dq=gk,
  )
  kernel = sk.make_splash_mqa(
    sm.MultiHeadMask([base] * g),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  qe = qs.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  ke, ve = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, X]
  if segment_ids is None:
    per_head = lambda qh, kh_, vh: kernel(qh, kh_, vh)  # noqa: E731
    out = jax.vmap(jax.vmap(per_head))(qe, ke, ve)
  else:
    mask = normalize_mask_args(b, t, s, segment_ids)
    seg = sk.SegmentIds(q=mask.q_segment_ids, kv=mask.kv_segment_ids)

    def per_example(qb, kb, vb, sg):
      return jax.vmap(lambda qh, kh_, vh: kernel(qh, kh_, vh, segment_ids=sg))(qb, kb, vb)

    out = jax.vmap(per_example)(qe, ke, ve, seg)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, -1)  # [B, T, N, V]
  return _zero_padding_rows(out, segment_ids)
