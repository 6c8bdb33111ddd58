"""Fused CPU flash attention: the JAX binding of the C++ kernel in cpu_attention.cc.

The kernel is built, cached and registered with XLA FFI by cpu_build.py; where it
cannot be built, `available()` is False and says why, and
`flash_attention(backend="auto")` stays on the pure-JAX blockwise kernel.

Scope: float32 q/k/v, head dims that are multiples of 16, any mask of
masking.py (segments, causal, window on explicit positions), GQA/MQA. One call
runs on one device's shard (inside shard_map that is the local block), single
threaded: on the fake-device CPU mesh every device already has its own thread.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lctx.kernels import cpu_build, flop_tags
from lctx.kernels.cpu_build import BWD_TARGET, FWD_TARGET, available, unavailable_reason
from lctx.kernels.masking import check_shapes, default_scale, normalize_mask_args, pad_axis
from lctx.kernels.options import AttentionOptions
from lctx.kernels.remat_tags import tag_residuals
from lctx.kernels.shard_typing import cotangent_like, varying_like

_Q_MULT, _KV_MULT = 8, 64  # the kernel's length granules (cpu_attention.cc)

# The blocks this kernel runs best with on its own (flash_attention passes the caller's).
DEFAULT_OPTIONS = AttentionOptions(block_q=64, block_kv=256)


def auto_applies(q, k, v, platform: str) -> bool:
  """Whether backend "auto" takes this kernel: the CPU platform, inputs it takes,
  and the kernel built here."""
  return platform == "cpu" and not unsupported(q, k, v) and cpu_build.available()


def unsupported(q, k, v) -> str:
  """Why these inputs cannot use the kernel ('' if they can)."""
  _, _, _, _, _, h, vd = check_shapes(q, k, v)
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if dtypes != {jnp.dtype(jnp.float32)}:
    return f"the fused CPU kernel takes float32 q/k/v (got {sorted(map(str, dtypes))})"
  if h % 16 or vd % 16:
    return f"the fused CPU kernel needs head dims that are multiples of 16 (got {h}, {vd})"
  return ""


class _Cfg(NamedTuple):
  """The kernel's settings for one call, resolved from its AttentionOptions
  (_setup): blocks rounded to the granules, the scale, FLOP counts."""

  causal: bool
  window: int  # 0: none
  scale: float
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int
  # FLOPs of one forward / backward call (flop_tags.py), from the kernel's block
  # classes on the mask inputs known at trace time.
  fwd_flops: float = 0.0
  bwd_flops: float = 0.0


def _round_block(block: int, mult: int, length: int) -> int:
  return max(mult, min(block, length) // mult * mult)


def _attrs(cfg: _Cfg, backward: bool):
  return dict(
    causal=np.int64(cfg.causal),
    window=np.int64(cfg.window),
    scale=np.float32(cfg.scale),
    block_q=np.int64(cfg.block_q_bwd if backward else cfg.block_q),
    block_kv=np.int64(cfg.block_kv_bwd if backward else cfg.block_kv),
  )


def _fwd_call(q, k, v, mask_arrays, cfg: _Cfg):
  b, t, n, _ = q.shape
  vd = v.shape[-1]
  call = jax.ffi.ffi_call(
    FWD_TARGET,
    (
      jax.ShapeDtypeStruct((b, t, n, vd), jnp.float32),
      jax.ShapeDtypeStruct((b, n, t), jnp.float32),
    ),
    vmap_method="sequential",
  )
  with flop_tags.flops_scope(cfg.fwd_flops):
    out, lse = call(q, k, v, *mask_arrays, **_attrs(cfg, False))
  # Inside shard_map, FFI results carry no device-varying type: give them the inputs'.
  return tuple(varying_like(x, q, k, v, *mask_arrays) for x in (out, lse))


def _bwd_call(q, k, v, dout, lse, delta, mask_arrays, cfg: _Cfg):
  """(dq, dk, dv) f32 given lse and delta = rowsum(dout * out) - dlse, `[B, N, T]`."""
  call = jax.ffi.ffi_call(
    BWD_TARGET,
    (
      jax.ShapeDtypeStruct(q.shape, jnp.float32),
      jax.ShapeDtypeStruct(k.shape, jnp.float32),
      jax.ShapeDtypeStruct(v.shape, jnp.float32),
    ),
    vmap_method="sequential",
  )
  with flop_tags.flops_scope(cfg.bwd_flops):
    dq, dk, dv = call(q, k, v, dout, lse, delta, *mask_arrays, **_attrs(cfg, True))
  return tuple(varying_like(x, q, k, v, dout, lse, delta, *mask_arrays) for x in (dq, dk, dv))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(q, k, v, mask_arrays, cfg: _Cfg):
  return _fwd_call(q, k, v, mask_arrays, cfg)


def _fused_fwd(q, k, v, mask_arrays, cfg):
  out, lse = tag_residuals(*_fwd_call(q, k, v, mask_arrays, cfg))
  return (out, lse), (q, k, v, out, lse, mask_arrays)


def _fused_bwd(cfg, res, cts):
  q, k, v, out, lse, mask_arrays = res
  dout, dlse = cts
  delta = jnp.sum(dout * out, axis=-1).transpose(0, 2, 1) - dlse  # [B, N, T]
  dq, dk, dv = _bwd_call(q, k, v, dout, lse, delta, mask_arrays, cfg)
  every = (q, k, v, dout, *mask_arrays)
  dq, dk, dv = (cotangent_like(ct, p, *every) for ct, p in zip((dq, dk, dv), (q, k, v)))
  zeros = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), mask_arrays)
  return dq, dk, dv, zeros


_fused.defvjp(_fused_fwd, _fused_bwd)


def _setup(q, k, v, segment_ids, q_positions, kv_positions, options: AttentionOptions):
  """Validates and pads to the kernel's granules (q: 8 rows, kv: 64 keys; padding
  gets segment 0, so it is invisible). Returns (q, k, v, mask_arrays, cfg) padded."""
  b, t, s, _, _, h, _ = check_shapes(q, k, v)
  if jax.default_backend() != "cpu":
    raise ValueError(
      "backend='cpu' runs on the XLA CPU backend only; this process "
      f"computes on {jax.default_backend()!r}"
    )
  why = unsupported(q, k, v)
  if why:
    raise ValueError(f"backend='cpu': {why}")
  ok, reason = cpu_build.load()
  if not ok:
    raise RuntimeError(f"backend='cpu': the fused CPU kernel is unavailable: {reason}")
  o = options
  mask = normalize_mask_args(b, t, s, segment_ids, q_positions, kv_positions, o.window_size)
  tp, sp = -(-t // _Q_MULT) * _Q_MULT, -(-s // _KV_MULT) * _KV_MULT
  q_seg = mask.q_segment_ids if mask.q_segment_ids is not None else jnp.ones((b, t), jnp.int32)
  kv_seg = mask.kv_segment_ids if mask.kv_segment_ids is not None else jnp.ones((b, s), jnp.int32)
  mask_arrays = (
    pad_axis(mask.q_positions, tp, 1),
    pad_axis(q_seg, tp, 1),
    pad_axis(mask.kv_positions, sp, 1),
    pad_axis(kv_seg, sp, 1),
  )
  cfg = _Cfg(
    o.causal,
    0 if o.window_size is None else o.window_size,
    default_scale(h, o.softmax_scale),
    _round_block(o.block_q, _Q_MULT, tp),
    _round_block(o.block_kv, _KV_MULT, sp),
    _round_block(o.block_q_bwd or o.block_q, _Q_MULT, tp),
    _round_block(o.block_kv_bwd or o.block_kv, _KV_MULT, sp),
  )
  cfg = cfg._replace(**_flops(cfg, q, v, t, s, segment_ids, q_positions, kv_positions))
  return pad_axis(q, tp, 1), pad_axis(k, sp, 1), pad_axis(v, sp, 1), mask_arrays, cfg


def _flops(cfg: _Cfg, q, v, t, s, segment_ids, q_positions, kv_positions):
  """fwd_flops / bwd_flops of one call: the live blocks of the kernel's block
  classes (block_map.py's rule), each computed at its true size, the last one
  shorter (the rows _setup pads on are a few, and dead)."""
  b, n, h, vd = q.shape[0], q.shape[2], q.shape[3], v.shape[3]
  out = {}
  for name, bq, bk, per_pair in (
    ("fwd_flops", cfg.block_q, cfg.block_kv, flop_tags.forward_pair_flops(h, vd)),
    ("bwd_flops", cfg.block_q_bwd, cfg.block_kv_bwd, flop_tags.fa2_backward_pair_flops(h, vd)),
  ):
    masks = (segment_ids, q_positions, kv_positions, cfg.causal, cfg.window or None)
    live = flop_tags.live_map(b, t, s, *masks, bq, bk)
    out[name] = n * flop_tags.block_pairs(live, t, s, bq, bk) * per_pair
  return out


def attend(
  q, k, v, *, segment_ids, q_positions, kv_positions, return_lse, options: AttentionOptions
):
  """The fused kernel with these options (see cpu_fused_attention)."""
  t = q.shape[1]
  qp, kp, vp, mask_arrays, cfg = _setup(q, k, v, segment_ids, q_positions, kv_positions, options)
  out, lse = _fused(qp, kp, vp, mask_arrays, cfg)
  out, lse = out[:, :t], lse[:, :, :t]
  return (out, lse) if return_lse else out


def cpu_fused_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  return_lse=False,
  options: AttentionOptions = DEFAULT_OPTIONS,
):
  """Same contract as `lctx.kernels.reference_attention` (out `[B, T, N, V]`, and
  lse `[B, N, T]` f32 when return_lse; differentiable through both). The mask
  and blocks come from `options`; blocks are rounded down to the kernel's
  granules (q: 8 rows, kv: 64 keys)."""
  return attend(
    q,
    k,
    v,
    segment_ids=segment_ids,
    q_positions=q_positions,
    kv_positions=kv_positions,
    return_lse=return_lse,
    options=options,
  )


def cpu_block_forward(
  q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, options: AttentionOptions
):
  """`lctx.kernels.attention_block_forward` on the fused kernel (same contract: out
  f32 normalised within this K/V block, lse f32; not differentiable by itself)."""
  t = q.shape[1]
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  qp, kp, vp, mask_arrays, cfg = _setup(q, k, v, seg, q_positions, kv_positions, options)
  out, lse = _fwd_call(qp, kp, vp, mask_arrays, cfg)
  return out[:, :t], lse[:, :, :t]


def cpu_block_backward(
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
  """`lctx.kernels.attention_block_backward` on the fused kernel: FA2 gradients of
  one K/V block against the GLOBAL out/lse; (dq, dk, dv) f32."""
  t, s = q.shape[1], k.shape[1]
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  qp, kp, vp, mask_arrays, cfg = _setup(q, k, v, seg, q_positions, kv_positions, options)
  tp = qp.shape[1]
  dout = dout.astype(jnp.float32)
  delta = jnp.sum(dout * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)  # [B, N, T]
  lse = pad_axis(lse.astype(jnp.float32), tp, 2)
  dq, dk, dv = _bwd_call(
    qp, kp, vp, pad_axis(dout, tp, 1), lse, pad_axis(delta, tp, 2), mask_arrays, cfg
  )
  return dq[:, :t], dk[:, :s], dv[:, :s]


__all__ = [
  "attend",
  "auto_applies",
  "available",
  "cpu_block_backward",
  "cpu_block_forward",
  "cpu_fused_attention",
  "unavailable_reason",
  "unsupported",
]
