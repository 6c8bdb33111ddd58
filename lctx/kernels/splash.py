"""TPU splash attention (Pallas), the TPU backend of `lctx.kernels.flash_attention`.

Segment ids (packing; 0 = padding, never visible), causal and sliding-window
masks, GQA/MQA (q head n uses kv head n // G inside the kernel: K/V are never
copied), unequal q/k and v head dims (MLA). On the CPU backend the same kernels
run through the Pallas interpreter (interpret=True). Rows that see no key give
out 0 and lse MASKED_LSE, as every lctx kernel.

Masks follow the natural token index of a `Layout` (token_order.py, which says
what a layout promises about positions); `layout=None` means the array order is
the natural order for both q and kv (default positions, or
positions_in_order=True).

One job per module:
- token_order.py: the token orders (the zigzag rule) and `Layout`;
- splash_tiling.py: the per-call settings, the run-time block maps and their
  SMEM tiling, FLOPs per call;
- splash_calls.py: the library's Pallas kernel calls, whole or in pieces;
- splash_vjp.py: forward / backward over kv runs and the custom_vjp;
- here: what the kernel takes (`unsupported`) and the entry points.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lctx.kernels.masking import check_shapes, normalize_mask_args
from lctx.kernels.options import AttentionOptions
from lctx.kernels.splash_tiling import (
  LANES,
  MAX_BLOCK,
  MAX_BLOCK_MAP_BYTES,
  MAX_COMPUTE_BLOCK,
  SplashCall,
  block_map_bytes,
  call_config,
  kv_run,
  tiles,
)
from lctx.kernels.splash_vjp import attention, backward, forward, head_major, starts
from lctx.kernels.token_order import Layout, TokenOrder

__all__ = [
  "LANES",
  "MAX_BLOCK",
  "MAX_BLOCK_MAP_BYTES",
  "MAX_COMPUTE_BLOCK",
  "Layout",
  "TokenOrder",
  "splash_attention",
  "splash_block_backward",
  "splash_block_forward",
  "unsupported",
]

# Names the tests reach: the tiling of one call's settings.
_tiles = tiles
_block_map_bytes = block_map_bytes

_DEFAULTS = AttentionOptions()


def unsupported(q, k, v, *, positions_given: bool, layout: Layout | None = None) -> str:
  """Why these inputs cannot take the splash kernel ('' if they can)."""
  _, t, s, _, _, _, _ = check_shapes(q, k, v)
  if positions_given and layout is None:
    return (
      "splash masks on the natural token index: explicit positions need a token layout "
      "(the strategies pass one) or positions_in_order=True"
    )
  if t % LANES or s % LANES:
    return f"splash needs q_len and kv_len multiples of {LANES} (got {t}, {s})"
  if q.dtype not in (jnp.float32, jnp.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
    return (
      f"splash needs float32 or bfloat16 q/k/v of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    )
  if layout is not None:
    o = layout.order
    if t > o.length or s > o.length:
      return f"layout covers {o.length} tokens but the call has q_len {t}, kv_len {s}"
    run = kv_run(o, s)
    if s % run or run % LANES or (o.zigzag and s < o.length and o.chunk % run):
      return (
        f"kv_len {s} does not cut into zigzag chunks of {o.chunk} tokens in runs that are "
        f"multiples of {LANES}"
      )
  return ""


def _call(q, k, options: AttentionOptions, layout, interpret) -> SplashCall:
  # The SMEM budget is read here, at call time, so that it can be lowered for one
  # call (tests cut small calls into pieces this way).
  return call_config(q, k, options, layout, interpret, MAX_BLOCK_MAP_BYTES)


def _config(q, k, causal, window_size, softmax_scale, blocks, layout, interpret) -> SplashCall:
  """The settings of a call with these mask and (fwd q, fwd kv, bwd q, bwd kv) blocks."""
  bq, bk, gq, gk = blocks
  options = AttentionOptions(
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
    block_q=bq,
    block_kv=bk,
    block_q_bwd=gq,
    block_kv_bwd=gk,
  )
  return _call(q, k, options, layout, interpret)


def _check(q, k, v, positions_given, layout):
  why = unsupported(q, k, v, positions_given=positions_given, layout=layout)
  if why:
    raise ValueError(f"backend='splash': {why}")


def splash_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  return_lse=False,
  layout: Layout | None = None,
  positions_given: bool = False,
  interpret=False,
  options: AttentionOptions = _DEFAULTS,
):
  """Splash attention, differentiable in q, k, v (and through lse).

  q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`; segment_ids `[B, T]` or a
  (q_ids, kv_ids) pair (0 = padding); masks on the natural token index of
  `layout` (None: array order for both). Returns out `[B, T, N, V]` (and lse
  `[B, N, T]` float32 if return_lse). The mask and blocks come from `options`.
  interpret: run through the Pallas interpreter
  (any backend). Raises ValueError when the call cannot take the kernel (see
  `unsupported`; positions_given: the caller passed explicit positions that
  only a layout makes usable).
  """
  _check(q, k, v, positions_given, layout)
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  mask = normalize_mask_args(b, t, s, segment_ids, window_size=options.window_size)
  cfg = _call(q, k, options, layout, interpret)
  out, lse = attention(cfg, q, k, v, mask.q_segment_ids, mask.kv_segment_ids, *starts(layout))
  return (out, lse) if return_lse else out


def _block_call(
  q, k, v, q_segment_ids, kv_segment_ids, options, layout, positions_given, interpret
):
  """Checks, segment ids and settings of one block-API call (its backward uses the
  forward's blocks)."""
  _check(q, k, v, positions_given, layout)
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  mask = normalize_mask_args(b, t, s, seg, window_size=options.window_size)
  options = dataclasses.replace(options, block_q_bwd=None, block_kv_bwd=None)
  return mask, _call(q, k, options, layout, interpret)


def splash_block_forward(
  q,
  k,
  v,
  *,
  q_segment_ids,
  kv_segment_ids,
  options: AttentionOptions,
  layout: Layout | None = None,
  positions_given: bool = False,
  interpret=False,
):
  """One (visiting) K/V block for the ring: out `[B, T, N, V]` float32 normalised
  within the block, lse `[B, N, T]` (MASKED_LSE and out 0 where a row sees no key
  of the block). Not differentiable by itself (see splash_block_backward)."""
  mask, cfg = _block_call(
    q, k, v, q_segment_ids, kv_segment_ids, options, layout, positions_given, interpret
  )
  qh, kh, vh = head_major(q, k, v, cfg.scale)
  out, lse = forward(cfg, qh, kh, vh, mask.q_segment_ids, mask.kv_segment_ids, *starts(layout))
  return out.transpose(0, 2, 1, 3), lse


def splash_block_backward(
  q,
  k,
  v,
  out,
  lse,
  dout,
  *,
  q_segment_ids,
  kv_segment_ids,
  options: AttentionOptions,
  layout: Layout | None = None,
  positions_given: bool = False,
  interpret=False,
):
  """FA2 backward of one K/V block against the GLOBAL out `[B, T, N, V]` and lse
  `[B, N, T]`; dout its cotangent. Returns (dq, dk, dv) float32."""
  mask, cfg = _block_call(
    q, k, v, q_segment_ids, kv_segment_ids, options, layout, positions_given, interpret
  )
  qh, kh, vh = head_major(q, k, v, cfg.scale)
  dq, dk, dv = backward(
    cfg,
    qh,
    kh,
    vh,
    mask.q_segment_ids,
    mask.kv_segment_ids,
    *starts(layout),
    out.transpose(0, 2, 1, 3),
    lse,
    dout.transpose(0, 2, 1, 3),
    None,
  )
  return (
    (dq * cfg.scale).transpose(0, 2, 1, 3),
    dk.transpose(0, 2, 1, 3),
    dv.transpose(0, 2, 1, 3),
  )
