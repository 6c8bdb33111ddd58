"""Splash's forward and backward over kv runs, and its custom_vjp.

`forward` / `backward` take head-major arrays, cut kv into the runs the layout
asks for (a zigzag kv slice at its chunk boundaries; a kv holding the whole
zigzag sequence put back in natural order once, a copy of K/V) and merge the
runs through their lse. `attention` is the differentiable call on `[B, T, N, H]`
arrays: lse comes out, lse cotangents go in, and the backward runs the FA2
kernels against the saved out / lse. The ring's block backward calls `backward`
against the GLOBAL out / lse directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lctx.kernels import flop_tags
from lctx.kernels.remat_tags import tag_residuals
from lctx.kernels.shard_typing import cotangent_like
from lctx.kernels.splash_calls import backward_tiled, forward_tiled, merge
from lctx.kernels.splash_tiling import SplashCall, call_flops, kv_run, q_natural, run_starts
from lctx.kernels.token_order import TokenOrder


def _runs(cfg: SplashCall, k, v, kv_seg, kv_start):
  """kv `[B, K, S, X]` as runs contiguous in natural order: [(k, v, seg, nat start)]."""
  o, s = cfg.order, k.shape[2]
  if o.zigzag and s == o.length:  # the whole zigzag sequence: natural order, one run
    perm = np.argsort(o.slots())
    k, v = (_permute_chunks(x, perm, o, axis=2) for x in (k, v))
    kv_seg = None if kv_seg is None else _permute_chunks(kv_seg, perm, o, axis=1)
    return [(k, v, kv_seg, 0)]
  r = kv_run(o, s)
  return [
    (
      k[:, :, a : a + r],
      v[:, :, a : a + r],
      None if kv_seg is None else kv_seg[:, a : a + r],
      start,
    )
    for a, start in run_starts(cfg, s, kv_start)
  ]


def _permute_chunks(x, perm, order: TokenOrder, axis: int):
  shape = x.shape
  x = x.reshape(shape[:axis] + (len(perm), order.chunk) + shape[axis + 1 :])
  return jnp.take(x, jnp.asarray(perm), axis=axis).reshape(shape)


def forward(cfg: SplashCall, q, k, v, q_seg, kv_seg, q_start, kv_start):
  """q `[B, N, T, H]` (already scaled), k `[B, K, S, H]`, v `[B, K, S, V]`, segment
  ids `[B, T]` / `[B, S]` or None. Returns out `[B, N, T, V]` f32 and lse `[B, N, T]`
  (runs merged through their lse)."""
  h, vd = q.shape[3], v.shape[3]
  (fwd,) = call_flops(
    cfg, q, k, v, q_start, kv_start, [("block_q", "block_kv", flop_tags.forward_pair_flops(h, vd))]
  )
  qnat = q_natural(cfg, q_start, q.shape[2])
  out = lse = None
  with flop_tags.flops_scope(fwd):
    for kr, vr, sr, start in _runs(cfg, k, v, kv_seg, kv_start):
      o, l = forward_tiled(cfg, q, kr, vr, q_seg, sr, (qnat - start).astype(jnp.int32))
      out, lse = (o, l) if out is None else merge(out, lse, o, l)
  return out, lse


def backward(cfg: SplashCall, q, k, v, q_seg, kv_seg, q_start, kv_start, out, lse, dout, dlse):
  """FA2 backward against the GLOBAL out `[B, N, T, V]` / lse `[B, N, T]` (and an lse
  cotangent dlse or None). Returns dq (w.r.t. the scaled q), dk, dv, float32."""
  qnat = q_natural(cfg, q_start, q.shape[2])
  # delta = rowsum(dout * out) - dlse: the lse cotangent enters the FA2 backward here.
  di = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  if dlse is not None:
    di = di - dlse.astype(jnp.float32)
  do = dout.astype(v.dtype)
  h, vd = q.shape[3], v.shape[3]
  if cfg.fused_bwd:
    passes = [("block_q_dkv", "block_kv_dkv", flop_tags.fa2_backward_pair_flops(h, vd))]
  else:
    passes = [
      ("block_q_dkv", "block_kv_dkv", flop_tags.splash_dkv_pair_flops(h, vd)),
      ("block_q_dq", "block_kv_dq", flop_tags.splash_dq_pair_flops(h, vd)),
    ]
  flops = call_flops(cfg, q, k, v, q_start, kv_start, passes, backward=True)
  dq, dks, dvs = None, [], []
  for kr, vr, sr, start in _runs(cfg, k, v, kv_seg, kv_start):
    qseq = (qnat - start).astype(jnp.int32)
    dq_r, dk_r, dv_r = backward_tiled(cfg, q, kr, vr, q_seg, sr, qseq, lse, do, di, flops=flops)
    dq = dq_r if dq is None else dq + dq_r
    dks.append(dk_r)
    dvs.append(dv_r)
  dk, dv = (jnp.concatenate(x, axis=2) if len(x) > 1 else x[0] for x in (dks, dvs))
  o = cfg.order
  if o.zigzag and k.shape[2] == o.length:  # back from natural to zigzag order
    dk, dv = (_permute_chunks(x, o.slots(), o, axis=2) for x in (dk, dv))
  return dq, dk, dv


def head_major(q, k, v, scale):
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  return qs.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def starts(layout):
  if layout is None:
    return jnp.int32(0), jnp.int32(0)
  return jnp.asarray(layout.q_start, jnp.int32), jnp.asarray(layout.kv_start, jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg, q, k, v, q_seg, kv_seg, q_start, kv_start):
  out, lse = _attention_fwd(cfg, q, k, v, q_seg, kv_seg, q_start, kv_start)[0]
  return out, lse


def _attention_fwd(cfg, q, k, v, q_seg, kv_seg, q_start, kv_start):
  qh, kh, vh = head_major(q, k, v, cfg.scale)
  out, lse = forward(cfg, qh, kh, vh, q_seg, kv_seg, q_start, kv_start)
  out, lse = tag_residuals(out.astype(q.dtype), lse)  # head-major [B, N, T, V]
  return (out.transpose(0, 2, 1, 3), lse), (q, k, v, q_seg, kv_seg, q_start, kv_start, out, lse)


def _attention_bwd(cfg, res, cts):
  q, k, v, q_seg, kv_seg, q_start, kv_start, out, lse = res
  dout, dlse = cts
  qh, kh, vh = head_major(q, k, v, cfg.scale)
  dq, dk, dv = backward(
    cfg, qh, kh, vh, q_seg, kv_seg, q_start, kv_start, out, lse, dout.transpose(0, 2, 1, 3), dlse
  )
  # Typed like their primals inside shard_map (e.g. K/V replicated over tensor
  # for MQA while q is sharded there: summed over it).
  refs = (q, k, v, dout)
  dq = cotangent_like((dq * cfg.scale).transpose(0, 2, 1, 3), q, *refs).astype(q.dtype)
  dk = cotangent_like(dk.transpose(0, 2, 1, 3), k, *refs).astype(k.dtype)
  dv = cotangent_like(dv.transpose(0, 2, 1, 3), v, *refs).astype(v.dtype)
  return dq, dk, dv, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
