"""Public blockwise attention: layout changes, padding, custom_vjp, ring block API.

`blockwise_attention` is the portable (and fallback) backend of
`lctx.kernels.flash_attention`; `blockwise_block_forward` / `_backward` are its
form of the ring block API (`lctx.kernels.attention_block_forward` / `_backward`
dispatch to them), around which the ring strategy runs its own custom_vjp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lctx.kernels import flop_tags
from lctx.kernels.blockwise_core import Blocked, Cfg, backward_example, forward_example
from lctx.kernels.masking import (
  MASKED_LSE,
  MaskArgs,
  check_shapes,
  default_scale,
  normalize_mask_args,
  pad_axis,
)
from lctx.kernels.options import AttentionOptions
from lctx.kernels.remat_tags import tag_residuals
from lctx.kernels.shard_typing import cotangent_like

_F32 = jnp.float32

_DEFAULTS = AttentionOptions()


def _block_sizes(t, s, block_q, block_kv):
  if block_q < 1 or block_kv < 1:
    raise ValueError(f"block_q and block_kv must be >= 1; got {block_q}, {block_kv}")
  bq, bk = min(block_q, t), min(block_kv, s)
  return bq, bk, -(-t // bq), -(-s // bk)


def _prepare(q, k, v, mask: MaskArgs, cfg: Cfg):
  """To block layout. Returns qb `[B, nq, K, G*bq, H]` (scaled by cfg.scale),
  kb `[B, nk, K, bk, H]`, vb `[B, nk, K, bk, V]`, Blocked with `[B, n, b]` leaves."""
  b, t, s, n, kh, h, vd = check_shapes(q, k, v)
  g = n // kh
  bq, bk, nq, nk = cfg.block_q, cfg.block_kv, -(-t // cfg.block_q), -(-s // cfg.block_kv)
  q_seg, kv_seg = mask.q_segment_ids, mask.kv_segment_ids
  if (nq * bq != t or nk * bk != s) and q_seg is None:
    # Padding must be invisible: give real tokens segment 1 and padding 0.
    q_seg, kv_seg = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
  q = pad_axis(q, nq * bq, 1)
  k, v = pad_axis(k, nk * bk, 1), pad_axis(v, nk * bk, 1)
  qp, kp = pad_axis(mask.q_positions, nq * bq, 1), pad_axis(mask.kv_positions, nk * bk, 1)
  if q_seg is not None:
    q_seg, kv_seg = pad_axis(q_seg, nq * bq, 1), pad_axis(kv_seg, nk * bk, 1)
  qs = (
    (q * jnp.asarray(cfg.scale, q.dtype))
    if q.dtype == _F32
    else (q.astype(_F32) * cfg.scale).astype(q.dtype)
  )
  qb = qs.reshape(b, nq, bq, kh, g, h).transpose(0, 1, 3, 4, 2, 5).reshape(b, nq, kh, g * bq, h)
  kb = k.reshape(b, nk, bk, kh, h).transpose(0, 1, 3, 2, 4)
  vb = v.reshape(b, nk, bk, kh, vd).transpose(0, 1, 3, 2, 4)
  bl = Blocked(
    qp.reshape(b, nq, bq),
    None if q_seg is None else q_seg.reshape(b, nq, bq),
    kp.reshape(b, nk, bk),
    None if kv_seg is None else kv_seg.reshape(b, nk, bk),
  )
  return qb, kb, vb, bl


def _rows_to_btnx(x, b, t, n, g):
  """`[B, nq, K, G*bq, X]` -> `[B, T, N, X]` (dropping padded rows)."""
  _, nq, kh, rows, xd = x.shape
  bq = rows // g
  x = x.reshape(b, nq, kh, g, bq, xd).transpose(0, 1, 4, 2, 3, 5).reshape(b, nq * bq, n, xd)
  return x[:, :t]


def _btnx_to_rows(x, nq, kh, g, bq):
  """`[B, T, N, X]` -> `[B, nq, K, G*bq, X]` (padding rows with zeros)."""
  b, _, _, xd = x.shape
  x = pad_axis(x, nq * bq, 1)
  return x.reshape(b, nq, bq, kh, g, xd).transpose(0, 1, 3, 4, 2, 5).reshape(b, nq, kh, g * bq, xd)


def _lse_from_rows(lse, b, t, n, g):
  """`[B, nq, K, G*bq]` -> `[B, N, T]`."""
  return _rows_to_btnx(lse[..., None], b, t, n, g)[..., 0].transpose(0, 2, 1)


def _lse_to_rows(lse, nq, kh, g, bq):
  """`[B, N, T]` -> `[B, nq, K, G*bq]`."""
  return _btnx_to_rows(lse.transpose(0, 2, 1)[..., None], nq, kh, g, bq)[..., 0]


def _forward(q, k, v, mask: MaskArgs, cfg: Cfg):
  """out `[B, T, N, V]` f32, lse `[B, N, T]` f32, block counts `[B, 2]`."""
  b, t, _, n, kh, _, _ = check_shapes(q, k, v)
  qb, kb, vb, bl = _prepare(q, k, v, mask, cfg)
  out, lse, counts = jax.lax.map(
    lambda a: forward_example(cfg, a[0], a[1], a[2], Blocked(*a[3])), (qb, kb, vb, tuple(bl))
  )
  g = n // kh
  return _rows_to_btnx(out, b, t, n, g), _lse_from_rows(lse, b, t, n, g), counts


def _backward(q, k, v, out, lse, dout, dlse, mask: MaskArgs, cfg: Cfg):
  """Gradients (f32) w.r.t. q, k, v given the (global) out/lse and cotangents."""
  b, t, s, n, kh, h, vd = check_shapes(q, k, v)
  g = n // kh
  qb, kb, vb, bl = _prepare(q, k, v, mask, cfg)
  nq, bq = qb.shape[1], cfg.block_q
  delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)  # [B, T, N]
  delta = delta.transpose(0, 2, 1)
  if dlse is not None:
    # d lse / d s = softmax, so an lse cotangent enters exactly like -delta.
    delta = delta - dlse.astype(_F32)
  dob = _btnx_to_rows(dout.astype(q.dtype), nq, kh, g, bq)
  lse_r = _lse_to_rows(lse.astype(_F32), nq, kh, g, bq)
  delta_r = _lse_to_rows(delta, nq, kh, g, bq)
  dq, dk, dv = jax.lax.map(
    lambda a: backward_example(cfg, a[0], a[1], a[2], a[3], a[4], a[5], Blocked(*a[6])),
    (qb, kb, vb, dob, lse_r, delta_r, tuple(bl)),
  )
  dq = _rows_to_btnx(dq, b, t, n, g) * cfg.scale
  dk = dk.transpose(0, 1, 3, 2, 4).reshape(b, -1, kh, h)[:, :s]
  dv = dv.transpose(0, 1, 3, 2, 4).reshape(b, -1, kh, vd)[:, :s]
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, mask: MaskArgs, cfg: Cfg):
  out, lse, _ = _forward(q, k, v, mask, cfg)
  return out.astype(q.dtype), lse


def _flash_fwd(q, k, v, mask, cfg):
  out, lse, _ = _forward(q, k, v, mask, cfg)
  out, lse = tag_residuals(out.astype(q.dtype), lse)
  return (out, lse), (q, k, v, out, lse, mask)


def _flash_bwd(cfg, res, cts):
  q, k, v, out, lse, mask = res
  dout, dlse = cts
  dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, mask, cfg.for_backward())
  every = (q, k, v, dout, *mask)
  dq, dk, dv = (cotangent_like(ct, p, *every) for ct, p in zip((dq, dk, dv), (q, k, v)))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _setup(
  q, k, v, segment_ids, q_positions, kv_positions, options: AttentionOptions, count_blocks=False
):
  """The mask inputs and the kernel's settings (blocks clipped to the lengths, the
  scale, the live-block trip counts for FLOP counts) of one call."""
  b, t, s, _, _, h, _ = check_shapes(q, k, v)
  o = options
  mask = normalize_mask_args(b, t, s, segment_ids, q_positions, kv_positions, o.window_size)
  bq, bk, _, _ = _block_sizes(t, s, o.block_q, o.block_kv)
  bwd_q, bwd_kv, _, _ = _block_sizes(t, s, o.block_q_bwd or o.block_q, o.block_kv_bwd or o.block_kv)
  masks = (segment_ids, q_positions, kv_positions, o.causal, o.window_size)
  fwd_live = flop_tags.live_map(b, t, s, *masks, bq, bk).sum()
  bwd_live = flop_tags.live_map(b, t, s, *masks, bwd_q, bwd_kv).sum()
  cfg = Cfg(
    o.causal,
    o.window_size,
    default_scale(h, o.softmax_scale),
    bq,
    bk,
    count_blocks,
    bwd_q,
    bwd_kv,
    fwd_trips=fwd_live / (b * -(-t // bq)),
    bwd_trips=bwd_live / (b * -(-s // bwd_kv)),
  )
  return mask, cfg


def blockwise_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  return_lse=False,
  options: AttentionOptions = _DEFAULTS,
):
  """Block-sparse flash attention (pure JAX). Same contract as
  `lctx.kernels.reference_attention`: out `[B, T, N, V]` in q.dtype, and lse
  `[B, N, T]` f32 when return_lse. Gradients flow through out and lse.
  The mask and blocks come from `options` (block_q_bwd, block_kv_bwd: the
  backward pass's blocks; None: the forward's)."""
  mask, cfg = _setup(q, k, v, segment_ids, q_positions, kv_positions, options)
  out, lse = _flash(q, k, v, mask, cfg)
  return (out, lse) if return_lse else out


def blockwise_block_counts(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  options: AttentionOptions = _DEFAULTS,
):
  """Debug: int32 `[B, 2]` = (blocks computed, of which masked) per example, counted
  inside the forward kernel's loop, plus the forward out. For tests of skipping."""
  mask, cfg = _setup(q, k, v, segment_ids, q_positions, kv_positions, options, count_blocks=True)
  out, _, counts = _forward(q, k, v, mask, cfg)
  return counts, out.astype(q.dtype)


def blockwise_block_forward(
  q,
  k,
  v,
  *,
  q_segment_ids,
  kv_segment_ids,
  q_positions,
  kv_positions,
  options: AttentionOptions,
):
  """Attention of q against one (e.g. visiting ring) K/V block, for merging.

  q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`; segment ids may both be None.
  Returns out `[B, T, N, V]` float32, normalised within this block, and lse
  `[B, N, T]` float32 (MASKED_LSE where a row sees no key of this block; its out
  is 0). Merge two partials with lse = logaddexp(lse_a, lse_b),
  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse). Not differentiable
  by itself: use blockwise_block_backward in the caller's custom_vjp.
  """
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  mask, cfg = _setup(q, k, v, seg, q_positions, kv_positions, options)
  out, lse, _ = _forward(q, k, v, mask, cfg)
  return out, lse


def blockwise_block_backward(
  q,
  k,
  v,
  out,
  lse,
  dout,
  *,
  q_segment_ids,
  kv_segment_ids,
  q_positions,
  kv_positions,
  options: AttentionOptions,
):
  """FA2 backward of one K/V block against the GLOBAL (merged) out and lse.

  out `[B, T, N, V]` and lse `[B, N, T]` are the final merged results over all
  K/V blocks, dout `[B, T, N, V]` its cotangent. Returns (dq `[B, T, N, H]`,
  dk `[B, S, K, H]`, dv `[B, S, K, V]`), float32, this block's contributions
  (sum dq over blocks; dk/dv belong to this block). Uses options' forward blocks.
  """
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  mask, cfg = _setup(q, k, v, seg, q_positions, kv_positions, options)
  return _backward(q, k, v, out, lse, dout, None, mask, cfg)


__all__ = [
  "MASKED_LSE",
  "blockwise_attention",
  "blockwise_block_backward",
  "blockwise_block_counts",
  "blockwise_block_forward",
]
