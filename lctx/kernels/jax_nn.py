"""The two `jax.nn.dot_product_attention` backends of `lctx.kernels.flash_attention`.

- "xla": the dense XLA implementation with the full visibility mask (a baseline:
  materialises the logits, no lse).
- "cudnn": cuDNN flash attention on GPU for plain causal/full masks in bf16/fp16,
  no segments, default or in-order positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lctx.kernels import flop_tags
from lctx.kernels.masking import check_shapes, default_scale, dense_mask, normalize_mask_args
from lctx.kernels.options import AttentionOptions

_DEFAULTS = AttentionOptions()


def cudnn_unsupported(q, k, v, segment_ids, positions_given, window_size, return_lse) -> str:
  """Why these inputs cannot take the cuDNN path ('' if they can)."""
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


def xla_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  options: AttentionOptions = _DEFAULTS,
):
  """`jax.nn.dot_product_attention(implementation="xla")` with the full mask as a
  dense `[B, 1, T, S]` boolean; rows without keys give 0. Quadratic memory. The
  mask comes from `options`."""
  causal, window_size, softmax_scale = options.causal, options.window_size, options.softmax_scale
  b, t, s, _, _, h, vd = check_shapes(q, k, v)
  if h != vd:
    raise ValueError(f"xla backend needs equal q/k and v head dims (got {h}, {vd})")
  mask = normalize_mask_args(b, t, s, segment_ids, q_positions, kv_positions, window_size)
  vis = dense_mask(mask, causal, window_size)  # [B, T, S]
  out = jax.nn.dot_product_attention(
    q, k, v, mask=vis[:, None], implementation="xla", scale=default_scale(h, softmax_scale)
  )
  return jnp.where(jnp.any(vis, axis=-1)[:, :, None, None], out, jnp.zeros_like(out))


# cuDNN's attention tile is internal to the library; FLOPs are counted as if it
# skipped whole CUDNN_TILE x CUDNN_TILE blocks above the causal diagonal.
CUDNN_TILE = 128


def cudnn_attention(q, k, v, *, options: AttentionOptions = _DEFAULTS):
  """cuDNN flash attention through jax.nn (callers check `cudnn_unsupported` first);
  the mask from `options`."""
  causal, softmax_scale = options.causal, options.softmax_scale
  b, t, s, n, _, h, vd = check_shapes(q, k, v)
  bq, bk = min(CUDNN_TILE, t), min(CUDNN_TILE, s)
  live = flop_tags.live_map(b, t, s, None, None, None, causal, None, bq, bk)
  pairs = n * flop_tags.block_pairs(live, t, s, bq, bk)
  fwd = pairs * flop_tags.forward_pair_flops(h, vd)
  with flop_tags.flops_scope(fwd, pairs * flop_tags.fa2_backward_pair_flops(h, vd)):
    return jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn", scale=default_scale(h, softmax_scale)
    )
