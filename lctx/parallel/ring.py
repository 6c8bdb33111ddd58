"""Ring attention: K/V blocks travel around the context ring; online-softmax merge.

Runs INSIDE `jax.shard_map` on local shards. Each of P devices holds one sequence
chunk (in whatever order the batch is in: natural or zigzag; masks come from the
carried positions and segment ids, never from indices). Forward: a scan over P
hops; at every hop the next K/V (+ ids, positions) ppermute is issued before this
hop's compute so XLA can overlap them; partial results merge through their lse.
A hop whose visiting keys are all masked for these queries (run-time min/max of
positions and ids) is skipped with lax.cond; long chunks are cut into sub-chunks
(cfg.sub_chunks, auto by default) whose pairs are skipped independently. Inside a hop
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
from lctx.parallel import block_ops
from lctx.parallel.block_ops import AttnConfig


def _varying(x, *refs):
    """pcast x to vary over every manual axis any ref varies over (scan carries)."""
    def vma(a):
        t = jax.typeof(a)
        v = getattr(t, "vma", None)
        if v is None:
            mat = getattr(t, "manual_axis_type", None)
            v = mat.varying if mat is not None else frozenset()
        return frozenset(v)

    missing = tuple(sorted(frozenset().union(*(vma(r) for r in refs)) - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _n_chunks(cfg: AttnConfig, length: int) -> int:
    return block_ops.ring_sub_chunks(cfg, length)


def _split(x, c, axis=1):
    return jnp.split(x, c, axis=axis) if c > 1 else [x]


def _cat(xs, axis=1):
    return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _hop_forward(qc, kv, acc, cfg):
    """Merges one visiting K/V block into the per-q-chunk (o, lse) accumulators."""
    k, v, ks, kp = kv
    c = len(qc)
    kvc = list(zip(_split(k, c), _split(v, c), _split(ks, c), _split(kp, c)))
    new = []
    for (qi, qsi, qpi), (o, lse) in zip(qc, acc):
        for kj, vj, ksj, kpj in kvc:
            def run(o, lse, qi=qi, qsi=qsi, qpi=qpi, kj=kj, vj=vj, ksj=ksj, kpj=kpj):
                ob, lb = block_ops.block_forward(
                    qi, kj, vj, q_seg=qsi, kv_seg=ksj, q_pos=qpi, kv_pos=kpj, cfg=cfg)
                return block_ops.merge(o, lse, ob, lb)

            vis = block_ops.maybe_visible(qsi, ksj, qpi, kpj, cfg)
            o, lse = jax.lax.cond(vis, run, lambda o, lse: (o, lse), o, lse)
        new.append((o, lse))
    return new


def _ring_forward(cfg, axis, size, q, k, v, seg, pos):
    """Returns out `[B, T, N, V]` (q.dtype) and lse `[B, N, T]` float32."""
    b, t, n, _ = q.shape
    vd = v.shape[-1]
    c = _n_chunks(cfg, t)
    qc = list(zip(_split(q, c), _split(seg, c), _split(pos, c)))
    acc = []
    for qi, _, _ in qc:
        o0 = jnp.zeros((b, qi.shape[1], n, vd), jnp.float32)
        l0 = jnp.full((b, n, qi.shape[1]), MASKED_LSE, jnp.float32)
        acc.append((_varying(o0, q, k, v), _varying(l0, q, k, v)))
    perm = [(i, (i + 1) % size) for i in range(size)]

    def step(carry, _):
        acc, kv = carry
        kv_next = tuple(jax.lax.ppermute(x, axis, perm) for x in kv)  # before compute
        return (_hop_forward(qc, kv, acc, cfg), kv_next), None

    kv = (k, v, seg, pos)
    if size > 1:
        (acc, kv), _ = jax.lax.scan(step, (acc, kv), length=size - 1)
    acc = _hop_forward(qc, kv, acc, cfg)
    out = _cat([o for o, _ in acc]).astype(q.dtype)
    lse = _cat([l for _, l in acc], axis=2)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(cfg, axis, size, q, k, v, seg, pos):
    return _ring_forward(cfg, axis, size, q, k, v, seg, pos)[0]


def _ring_fwd(cfg, axis, size, q, k, v, seg, pos):
    out, lse = _ring_forward(cfg, axis, size, q, k, v, seg, pos)
    return out, (q, k, v, seg, pos, out, lse)


def _hop_backward(qc, kv, dkv, dq, cfg):
    """Adds one visiting block's contributions to dq (local) and dk/dv (travelling)."""
    k, v, ks, kp = kv
    c = len(qc)
    kvc = list(zip(_split(k, c), _split(v, c), _split(ks, c), _split(kp, c)))
    dk = _split(dkv[0], c)
    dv = _split(dkv[1], c)
    dq = list(dq)
    for i, (qi, qsi, qpi, oi, li, doi) in enumerate(qc):
        for j, (kj, vj, ksj, kpj) in enumerate(kvc):
            def run(dqi, dkj, dvj, qi=qi, qsi=qsi, qpi=qpi, oi=oi, li=li, doi=doi,
                    kj=kj, vj=vj, ksj=ksj, kpj=kpj):
                a, b_, c_ = block_ops.block_backward(
                    qi, kj, vj, oi, li, doi, q_seg=qsi, kv_seg=ksj, q_pos=qpi,
                    kv_pos=kpj, cfg=cfg)
                return dqi + a, dkj + b_, dvj + c_

            vis = block_ops.maybe_visible(qsi, ksj, qpi, kpj, cfg)
            dq[i], dk[j], dv[j] = jax.lax.cond(
                vis, run, lambda *a: a, dq[i], dk[j], dv[j])
    return dq, (_cat(dk), _cat(dv))


def _ring_bwd(cfg, axis, size, res, dout):
    q, k, v, seg, pos, out, lse = res
    c = _n_chunks(cfg, q.shape[1])
    qc = list(zip(_split(q, c), _split(seg, c), _split(pos, c), _split(out, c),
                  _split(lse, c, axis=2), _split(dout, c)))
    dq = [_varying(jnp.zeros(qi.shape, jnp.float32), q, k, v, dout) for qi, *_ in qc]
    dkv = (_varying(jnp.zeros(k.shape, jnp.float32), q, k, v, dout),
           _varying(jnp.zeros(v.shape, jnp.float32), q, k, v, dout))
    perm = [(i, (i + 1) % size) for i in range(size)]

    def send(xs):
        return tuple(jax.lax.ppermute(x, axis, perm) for x in xs)

    def step(carry, _):
        dq, kv, dkv = carry
        kv_next = send(kv)  # issued before this hop's compute
        dq, dkv = _hop_backward(qc, kv, dkv, dq, cfg)
        return (dq, kv_next, send(dkv)), None

    kv = (k, v, seg, pos)
    if size > 1:
        (dq, kv, dkv), _ = jax.lax.scan(step, (dq, kv, dkv), length=size - 1)
    dq, dkv = _hop_backward(qc, kv, dkv, dq, cfg)
    if size > 1:
        dkv = send(dkv)  # the last hop's block belongs to the next device
    return (_cat(dq).astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype),
            None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_local(q, k, v, seg, pos, *, cfg: AttnConfig, axis_name: str,
                         axis_size: int):
    """Ring attention over `axis_name` (size P) on local shards; returns `[B, T, N, V]`."""
    return _ring(cfg, axis_name, int(axis_size), q, k, v, seg, pos)
