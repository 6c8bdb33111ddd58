"""Ring attention: K/V blocks travel around the context ring; online-softmax merge.

Runs INSIDE `jax.shard_map` on local shards. Each of P devices holds one sequence
chunk (in whatever order the batch is in: natural or zigzag; masks come from the
carried positions and segment ids, never from indices; kernels that mask on the
natural token index (splash) get each call's token layout instead: this device's
chunk, the visiting chunk of device (r - hop) mod P, the pieces' offsets). Forward: a scan over P
hops; at every hop the next K/V (+ ids, positions) ppermute is issued before this
hop's compute so XLA can overlap them; partial results merge through their lse.
A hop whose visiting keys are all masked for these queries (run-time min/max of
positions and ids) is skipped with lax.cond; long chunks are cut into sub-chunks
(ContextOptions.sub_chunks, auto by default) whose pairs are skipped independently, in one
fori_loop over the pairs (traced once, not c^2 times). Inside a hop
the kernel's block functions skip masked blocks themselves. Backward (custom_vjp): K/V rotate again, dQ accumulates locally and
dK/dV travel with their block until they arrive back at the owner.

Local shapes: q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K, V]` (V may differ
from H: MLA; N % K == 0: MHA/GQA/MQA), seg/pos `[B, T]` int32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lctx.kernels.masking import MASKED_LSE
from lctx.kernels.options import AttentionOptions
from lctx.kernels.remat_tags import tag_residuals
from lctx.kernels.shard_typing import cotangent_like, varying_like
from lctx.parallel import block_ops
from lctx.parallel.options import ContextOptions


def _n_chunks(ctx: ContextOptions, length: int) -> int:
  return block_ops.ring_sub_chunks(ctx, length)


def _piece(x, i, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def _put(x, piece, i, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, piece, i * piece.shape[axis], axis=axis)


def _pairs(c, body, carry, operands):
  """Runs body(i, j, carry, operands) over the c x c (q piece, kv piece) pairs:
  one traced body instead of c^2 unrolled kernel calls (cheap tracing at 8 x 8).

  The loop-invariant operands (the arrays the pieces are cut from) pass through
  an optimization barrier with the carry in every iteration, so partial
  evaluation (remat, a linearized layer scan) cannot hoist their pieces out of
  the loop as stacked `[pairs, ...]` copies (see _opaque).
  """
  if c == 1:
    return body(0, 0, carry, operands)

  def step(p, cr):
    cr, ops = jax.lax.optimization_barrier((cr, operands))
    return body(p // c, p % c, cr, ops)

  return jax.lax.fori_loop(0, c * c, step, carry)


def _starts(axis, size, t, hop):
  """Global array starts of this device's q chunk and of the K/V block visiting at
  `hop` (it comes from device (r - hop) mod P), for the kernels' token layout."""
  r = jax.lax.axis_index(axis)
  return r * t, ((r - hop) % size) * t


def _layout(ctx, size, q, starts, i, j, s):
  """Token layout of the (q piece i, kv piece j) call (None: no static order)."""
  q0, k0 = starts
  return block_ops.token_layout(ctx, q.shape[1] * size, q0 + i * s, k0 + j * s)


def _hop_forward(q, seg, pos, kv, acc, c, cfg, ctx, size, starts):
  """Merges one visiting K/V block into the (o, lse) accumulators, piece pair by
  piece pair; a pair whose keys are all masked for its queries is skipped."""
  s = q.shape[1] // c

  def body(i, j, acc, operands):
    q, seg, pos, (k, v, ks, kp) = operands
    o, lse = acc
    qi, qsi, qpi = _piece(q, i, s), _piece(seg, i, s), _piece(pos, i, s)
    kj, vj, ksj, kpj = (_piece(x, j, s) for x in (k, v, ks, kp))

    def run(oi, li):
      layout = _layout(ctx, size, q, starts, i, j, s)
      ob, lb = block_ops.block_forward(
        qi, kj, vj, q_seg=qsi, kv_seg=ksj, q_pos=qpi, kv_pos=kpj, cfg=cfg, layout=layout
      )
      return block_ops.merge(oi, li, ob, lb)

    vis = block_ops.maybe_visible(qsi, ksj, qpi, kpj, cfg)
    oi, li = jax.lax.cond(
      vis, run, lambda oi, li: (oi, li), _piece(o, i, s), _piece(lse, i, s, axis=2)
    )
    return _put(o, oi, i), _put(lse, li, i, axis=2)

  return _pairs(c, body, acc, (q, seg, pos, kv))


def _opaque(*xs):
  """The arguments, behind one optimization barrier, so the ring is one unit to
  JAX's partial evaluation.

  Under a layer `lax.scan` (nn.scan) the model's segment ids and positions are
  loop constants while q/k/v vary. Linearizing the layer scan hoists whatever
  depends only on loop constants out of it (jax's `_scan_known_hoisting`), and
  that reaches into the hop scan and the pairs loop: the masks, block maps and
  `lax.cond` residuals of every (hop, pair) were computed up front and kept,
  stacked `[hops, pairs, ...]` (f32 `[15, 64, 8, 8192, 128]` buffers at Llama-8B
  on v5p). Behind the barrier everything depends on q, so nothing is hoisted.
  """
  return jax.lax.optimization_barrier(xs)


def _ring_forward(cfg, ctx, axis, size, q, k, v, seg, pos):
  """Returns out `[B, T, N, V]` (q.dtype) and lse `[B, N, T]` float32."""
  q, k, v, seg, pos = _opaque(q, k, v, seg, pos)
  b, t, n, _ = q.shape
  c = _n_chunks(ctx, t)
  o0 = jnp.zeros((b, t, n, v.shape[-1]), jnp.float32)
  l0 = jnp.full((b, n, t), MASKED_LSE, jnp.float32)
  acc = (varying_like(o0, q, k, v), varying_like(l0, q, k, v))
  perm = [(i, (i + 1) % size) for i in range(size)]

  def step(carry, hop):
    acc, kv = carry
    kv_next = tuple(jax.lax.ppermute(x, axis, perm) for x in kv)  # before compute
    starts = _starts(axis, size, t, hop)
    return (_hop_forward(q, seg, pos, kv, acc, c, cfg, ctx, size, starts), kv_next), None

  kv = (k, v, seg, pos)
  if size > 1:
    (acc, kv), _ = jax.lax.scan(step, (acc, kv), jnp.arange(size - 1))
  o, lse = _hop_forward(q, seg, pos, kv, acc, c, cfg, ctx, size, _starts(axis, size, t, size - 1))
  return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(cfg, ctx, axis, size, q, k, v, seg, pos):
  return _ring_forward(cfg, ctx, axis, size, q, k, v, seg, pos)[0]


def _ring_fwd(cfg, ctx, axis, size, q, k, v, seg, pos):
  out, lse = tag_residuals(*_ring_forward(cfg, ctx, axis, size, q, k, v, seg, pos))
  return out, (q, k, v, seg, pos, out, lse)


def _hop_backward(res, kv, dkv, dq, c, cfg, ctx, size, starts):
  """Adds one visiting block's contributions to dq (local) and dk/dv (travelling)."""
  s = res[0].shape[1] // c

  def body(i, j, carry, operands):
    (q, seg, pos, out, lse, dout), (k, v, ks, kp) = operands
    dq, dk, dv = carry
    qi, qsi, qpi, oi, doi = (_piece(x, i, s) for x in (q, seg, pos, out, dout))
    li = _piece(lse, i, s, axis=2)
    kj, vj, ksj, kpj = (_piece(x, j, s) for x in (k, v, ks, kp))

    def run(dqi, dkj, dvj):
      layout = _layout(ctx, size, q, starts, i, j, s)
      a, b_, c_ = block_ops.block_backward(
        qi,
        kj,
        vj,
        oi,
        li,
        doi,
        q_seg=qsi,
        kv_seg=ksj,
        q_pos=qpi,
        kv_pos=kpj,
        cfg=cfg,
        layout=layout,
      )
      return dqi + a, dkj + b_, dvj + c_

    vis = block_ops.maybe_visible(qsi, ksj, qpi, kpj, cfg)
    dqi, dkj, dvj = jax.lax.cond(
      vis, run, lambda *a: a, _piece(dq, i, s), _piece(dk, j, s), _piece(dv, j, s)
    )
    return _put(dq, dqi, i), _put(dk, dkj, j), _put(dv, dvj, j)

  dq, dk, dv = _pairs(c, body, (dq, dkv[0], dkv[1]), (res, kv))
  return dq, (dk, dv)


def _ring_bwd(cfg, ctx, axis, size, res, dout):
  # The cotangents are typed like the primals as they came in: behind the
  # barrier every operand varies over the union of their axes (K/V replicated
  # over tensor for MQA would look sharded there).
  primals = res[:3]
  q, k, v, seg, pos, out, lse, dout = _opaque(*res, dout)
  c = _n_chunks(ctx, q.shape[1])
  res = (q, seg, pos, out, lse, dout)
  dq = varying_like(jnp.zeros(q.shape, jnp.float32), q, k, v, dout)
  dkv = (
    varying_like(jnp.zeros(k.shape, jnp.float32), q, k, v, dout),
    varying_like(jnp.zeros(v.shape, jnp.float32), q, k, v, dout),
  )
  perm = [(i, (i + 1) % size) for i in range(size)]

  def send(xs):
    return tuple(jax.lax.ppermute(x, axis, perm) for x in xs)

  t = q.shape[1]

  def step(carry, hop):
    dq, kv, dkv = carry
    kv_next = send(kv)  # issued before this hop's compute
    dq, dkv = _hop_backward(res, kv, dkv, dq, c, cfg, ctx, size, _starts(axis, size, t, hop))
    return (dq, kv_next, send(dkv)), None

  kv = (k, v, seg, pos)
  if size > 1:
    (dq, kv, dkv), _ = jax.lax.scan(step, (dq, kv, dkv), jnp.arange(size - 1))
  dq, dkv = _hop_backward(res, kv, dkv, dq, c, cfg, ctx, size, _starts(axis, size, t, size - 1))
  if size > 1:
    dkv = send(dkv)  # the last hop's block belongs to the next device
  # Typed like their primals (K/V replicated over tensor for MQA: summed there).
  refs = (q, k, v, dout)
  return (
    cotangent_like(dq, primals[0], *refs).astype(q.dtype),
    cotangent_like(dkv[0], primals[1], *refs).astype(k.dtype),
    cotangent_like(dkv[1], primals[2], *refs).astype(v.dtype),
    None,
    None,
  )


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(
  q, k, v, seg, pos, *, cfg: AttentionOptions, ctx: ContextOptions, axis_name: str, axis_size: int
):
  """Ring attention over `axis_name` (size P) on local shards; returns `[B, T, N, V]`.
  cfg: the kernel settings; ctx: the ring's pieces and token order."""
  return _ring(cfg, ctx, axis_name, int(axis_size), q, k, v, seg, pos)
