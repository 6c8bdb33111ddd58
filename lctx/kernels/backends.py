"""`flash_attention`: one entry point, backend chosen by platform and mask.

- "blockwise": the pure-JAX block-sparse kernel (blockwise.py); any mask, lse.
- "cpu": the fused C++ kernel on the XLA CPU backend (cpu_fused.py, through XLA
  FFI): the same masks and lse as blockwise, float32 and head dims that are
  multiples of 16; compiled on first use.
- "reference": the dense plain-jnp reference.
- "xla": `jax.nn.dot_product_attention(implementation="xla")` with a dense mask
  (a baseline: materialises the logits; no lse).
- "splash": TPU Pallas splash attention (segment ids; causal/local masks on
  array order, so only with default positions or positions_in_order=True).
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` on GPU for plain
  causal/full masks, bf16/fp16, no segments, default or in-order positions.
- "auto": splash on TPU, cudnn on GPU and cpu on CPU where the call qualifies
  (for cpu: the kernel also built here), else blockwise.

Explicitly requested fast backends raise a ValueError naming the rule they
cannot satisfy, rather than silently falling back. Everything imports on CPU:
Pallas/TPU modules are imported only when splash is used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lctx.kernels import cpu_fused
from lctx.kernels.blockwise import blockwise_attention
from lctx.kernels.masking import check_shapes, default_scale, dense_mask, normalize_mask_args
from lctx.kernels.reference import reference_attention

BACKENDS = ("auto", "blockwise", "cpu", "reference", "splash", "cudnn", "xla")


def _splash_unsupported(q, k, v, positions_given, return_lse) -> str:
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


def _cudnn_unsupported(q, k, v, segment_ids, positions_given, window_size, return_lse) -> str:
  _, t, s, _, _, h, vd = check_shapes(q, k, v)
  if return_lse:
    return "cudnn via jax.nn does not return lse (return_lse=True)"
  if segment_ids is not None:
    return "cudnn path takes no segment_ids (packing is not expressible here)"
  if positions_given:
    return "cudnn masks on array order; explicit positions need positions_in_order=True"
  if window_size is not None:
    return "cudnn path does not take window_size"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"cudnn flash attention needs bf16/fp16 (got {q.dtype})"
  if h != vd or h % 8 or h > 128:
    return f"cudnn needs equal head dims, a multiple of 8 and <= 128 (got {h}, {vd})"
  if t != s:
    return f"cudnn path needs q_len == kv_len (got {t}, {s})"
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


def xla_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  causal=True,
  window_size=None,
  softmax_scale=None,
):
  """`jax.nn.dot_product_attention(implementation="xla")` with the full mask as a
  dense `[B, 1, T, S]` boolean; rows without keys give 0. Quadratic memory."""
  b, t, s, _, _, h, vd = check_shapes(q, k, v)
  if h != vd:
    raise ValueError(f"xla backend needs equal q/k and v head dims (got {h}, {vd})")
  mask = normalize_mask_args(b, t, s, segment_ids, q_positions, kv_positions, window_size)
  vis = dense_mask(mask, causal, window_size)  # [B, T, S]
  out = jax.nn.dot_product_attention(
    q, k, v, mask=vis[:, None], implementation="xla", scale=default_scale(h, softmax_scale)
  )
  return jnp.where(jnp.any(vis, axis=-1)[:, :, None, None], out, jnp.zeros_like(out))


def flash_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  causal=True,
  window_size=None,
  softmax_scale=None,
  return_lse=False,
  block_q=512,
  block_kv=512,
  backend="auto",
  positions_in_order=False,
  block_q_bwd=None,
  block_kv_bwd=None,
):
  """Attention without the score matrix, skipping fully masked blocks.

  Args/returns as `lctx.kernels.reference_attention`: q `[B, T, N, H]`, k
  `[B, S, K, H]`, v `[B, S, K, V]`; segment_ids `[B, T]` or `(q_ids, kv_ids)`,
  0 = padding; causality and window on positions (default arange). Returns out
  `[B, T, N, V]` (and lse `[B, N, T]` f32 if return_lse). Differentiable in
  q, k, v (and through lse on the blockwise and cpu backends).
  backend: one of BACKENDS (see module docstring).
  block_q, block_kv: kernel blocks (blockwise, cpu, splash); block_q_bwd,
    block_kv_bwd: the backward pass's (None: the same).
  positions_in_order: the caller promises that positions count up by one along
    the array inside every segment, starting equal for q and kv (plain or packed
    rows, not zigzag-reordered, not a visiting ring block). Then the array-order
    masks of splash/cudnn are exact and those backends may be used although
    positions were passed. Ignored by blockwise/reference/xla.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
  check_shapes(q, k, v)
  common = dict(
    segment_ids=segment_ids,
    q_positions=q_positions,
    kv_positions=kv_positions,
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
  )
  positions_given = not positions_in_order and (q_positions is not None or kv_positions is not None)
  if backend == "auto":
    platform = jax.default_backend()
    if platform == "tpu" and not _splash_unsupported(q, k, v, positions_given, return_lse):
      backend = "splash"
    elif platform == "gpu" and not _cudnn_unsupported(
      q, k, v, segment_ids, positions_given, window_size, return_lse
    ):
      backend = "cudnn"
    elif platform == "cpu" and cpu_fused.auto_applies(q, k, v):
      backend = "cpu"
    else:
      backend = "blockwise"
  if backend == "blockwise":
    return blockwise_attention(
      q,
      k,
      v,
      return_lse=return_lse,
      block_q=block_q,
      block_kv=block_kv,
      block_q_bwd=block_q_bwd,
      block_kv_bwd=block_kv_bwd,
      **common,
    )
  if backend == "cpu":
    return cpu_fused.cpu_fused_attention(
      q,
      k,
      v,
      return_lse=return_lse,
      block_q=block_q,
      block_kv=block_kv,
      block_q_bwd=block_q_bwd,
      block_kv_bwd=block_kv_bwd,
      **common,
    )
  if backend == "reference":
    return reference_attention(q, k, v, return_lse=return_lse, **common)
  if backend == "xla":
    if return_lse:
      raise ValueError("backend='xla' cannot return lse; use 'blockwise' or 'reference'")
    return xla_attention(q, k, v, **common)
  if backend == "splash":
    why = _splash_unsupported(q, k, v, positions_given, return_lse)
    if why:
      raise ValueError(f"backend='splash': {why}")
    return splash_attention(
      q,
      k,
      v,
      segment_ids=segment_ids,
      causal=causal,
      window_size=window_size,
      softmax_scale=softmax_scale,
      block_q=block_q,
      block_kv=block_kv,
      block_q_bwd=block_q_bwd,
      block_kv_bwd=block_kv_bwd,
    )
  why = _cudnn_unsupported(q, k, v, segment_ids, positions_given, window_size, return_lse)
  if why:
    raise ValueError(f"backend='cudnn': {why}")
  h = q.shape[-1]
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=causal, implementation="cudnn", scale=default_scale(h, softmax_scale)
  )
