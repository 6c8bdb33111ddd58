"""Splash's calls into the library's Pallas kernels, whole or in SMEM-sized pieces.

Built on the Pallas kernels of `jax.experimental.pallas.ops.tpu.splash_attention`
(the installed jax): its private forward with `save_residuals` (which returns
the lse) and its backward kernels, so that splash_vjp.py can own the
custom_vjp: the fused dq+dkv kernel (cfg.fused_bwd; it writes dq partials
[kv blocks, *q.shape] in q's dtype and sums them, and `backward_tiled` keeps
them within cfg.dq_partial_bytes by its pieces; with bf16 q each partial is
rounded to bf16 before that sum), or the dkv kernel then the dq kernel. Each
function here runs one kv run (rows contiguous in natural order,
splash_tiling.py) on head-major arrays, vmapped over the batch; the `*_tiled`
forms cut a run whose block maps outgrow SMEM into pieces, merged through their
lse (forward) or summed (backward).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from lctx.kernels import flop_tags
from lctx.kernels.masking import MASKED_LSE
from lctx.kernels.shard_typing import varying_like
from lctx.kernels.splash_tiling import (
  SplashCall,
  block_sizes,
  bwd_tiles,
  library,
  mask_info,
  q_row_bytes,
  tiles,
)

VALID_LSE = -1e29  # any real lse is far above; the kernel gives ~-2.4e38 or -inf for no key


def segment_ids_for_kernel(q_seg, kv_seg):
  """Kernel segment ids: padding (0) made distinct on each side, so it sees nothing."""
  return library().SegmentIds(
    q=jnp.where(q_seg == 0, -1, q_seg), kv=jnp.where(kv_seg == 0, -2, kv_seg)
  )


def merge(o1, l1, o2, l2):
  lse = jnp.logaddexp(l1, l2)
  w1, w2 = jnp.exp(l1 - lse)[..., None], jnp.exp(l2 - lse)[..., None]
  return o1 * w1 + o2 * w2, lse


def _kernel_precision(dtype):
  """The matmul precision the library's kernels are traced under.

  A user's `jax.default_matmul_precision('highest')` (set for numerics; lctx's
  tests set it) reaches the kernels' dot_generals, which carry no precision of
  their own, as Mosaic's fp32 contract precision, and Mosaic refuses that for
  bfloat16 operands ("Bad lhs type"), so a bf16 splash step would not compile.
  For bf16 operands 'highest' adds nothing: products of bf16 values are exact
  in float32 and the kernels accumulate in float32 (preferred_element_type), so
  bf16 calls are traced at the default precision. float32 calls keep the
  caller's setting (Mosaic takes fp32 contract precision for f32 operands).
  """
  if jnp.dtype(dtype) == jnp.float32:
    return contextlib.nullcontext()
  return jax.default_matmul_precision("default")


def _outside_vma_check(call, args, refs, interpret: bool):
  """Runs a library kernel call where shard_map's varying-axes check is off.

  The library's pallas_call out shapes carry no varying axes, which a
  `check_vma=True` shard_map refuses (at trace and, interpreted, at lowering
  time). Inside a shard_map the call goes through a nested shard_map over no
  new axes with check_vma=False, and its outputs are typed as varying over the
  axes of its inputs (refs), which is what they are. Outside: call(*args).
  """
  mesh = jax.sharding.get_abstract_mesh()
  manual = set() if mesh.empty else set(mesh.manual_axes)
  if not manual:
    return call(*args)
  spec = jax.sharding.PartitionSpec()

  def untyped(*xs):
    if interpret:
      # Traced with the check off, an add drops the inputs' varying axes, so the
      # interpreter's loop carries (inputs in, outputs out) type-check too.
      xs = tuple(jax.lax.add(x, jax.lax.full_like(x, 0)) for x in xs)
    return call(*xs)

  inner = jax.shard_map(
    untyped, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=set(), check_vma=False
  )
  out = inner(*args)
  return jax.tree.map(lambda x: varying_like(x, *refs), out)


def _forward_run(cfg: SplashCall, q, k, v, q_seg, kv_seg, qseq):
  """One kv run: the kernel's forward with residuals, vmapped over the batch."""
  sk = library()
  t, s = q.shape[2], k.shape[2]
  sizes = block_sizes(cfg, t, s)
  info = mask_info(cfg, qseq, sizes.block_q, s, sizes.block_kv, dkv=False)

  def one(qb, kb, vb, seg):
    # The library's private forward: save_residuals=True returns the lse, which
    # its public custom_vjp refuses to differentiate; attention owns the vjp.
    return sk._splash_attention_forward(  # noqa: SLF001
      info,
      qb,
      kb,
      vb,
      seg,
      None,
      mask_value=sk.DEFAULT_MASK_VALUE,
      is_mqa=False,
      block_sizes=sizes,
      residual_checkpoint_name=None,
      save_residuals=True,
      mask_function=cfg.mask_fn,
      interpret=cfg.interpret,
    )

  if q_seg is None:
    call = jax.vmap(lambda a, b, c: one(a, b, c, None))
    args = (q, k, v)
  else:
    call = jax.vmap(lambda a, b, c, d, e: one(a, b, c, segment_ids_for_kernel(d, e)))
    args = (q, k, v, q_seg, kv_seg)
  with _kernel_precision(q.dtype):
    o, (lse,) = _outside_vma_check(call, args, (*args, qseq), cfg.interpret)
  seen = lse > VALID_LSE
  o = jnp.where(seen[..., None], o.astype(jnp.float32), 0.0)
  return o, jnp.where(seen, lse, MASKED_LSE)


def _backward_run(cfg: SplashCall, q, k, v, q_seg, kv_seg, qseq, lse, do, di, flops=(0, 0)):
  """One kv run: the kernel's fused pass (flops: (fused,)) or its dkv and dq
  passes (flops: (dkv, dq)), vmapped over the batch."""
  sk = library()
  t, s = q.shape[2], k.shape[2]
  sizes = block_sizes(cfg, t, s)
  # The fused kernel walks the whole (kv, q) grid (the library's unshrunk dkv
  # grid, which mask_info builds): every dq partial block is written, 0 if skipped.
  dkv_info = mask_info(cfg, qseq, sizes.block_q_dkv, s, sizes.block_kv_dkv, dkv=True)
  dq_info = (
    None
    if cfg.fused_bwd
    else mask_info(cfg, qseq, sizes.block_q_dq, s, sizes.block_kv_dq, dkv=False)
  )
  common = dict(
    is_mqa=False,
    mask_value=sk.DEFAULT_MASK_VALUE,
    attn_logits_soft_cap=None,
    q_layout=sizes.q_layout,
    k_layout=sizes.k_layout,
    v_layout=sizes.v_layout,
    mask_function=cfg.mask_fn,
    interpret=cfg.interpret,
  )

  def one(qb, kb, vb, lb, dob, dib, seg):
    if cfg.fused_bwd:
      with flop_tags.flops_scope(flops[0]):
        return _dkv(qb, kb, vb, lb, dob, dib, seg)
    with flop_tags.flops_scope(flops[0]):
      _, dk, dv = _dkv(qb, kb, vb, lb, dob, dib, seg)
    with flop_tags.flops_scope(flops[1]):
      dq = _dq(qb, kb, vb, lb, dob, dib, seg)
    return dq, dk, dv

  def _dkv(qb, kb, vb, lb, dob, dib, seg):
    # Fused: dq is the sum of the kernel's partials (`dq_unreduced.sum(axis=0)`).
    return sk._splash_attention_bwd_dkv(  # noqa: SLF001
      qb,
      kb,
      vb,
      seg,
      None,
      lb,
      dob,
      dib,
      bq=sizes.block_q_dkv,
      bkv=sizes.block_kv_dkv,
      bkv_compute=sizes.block_kv_dkv_compute,
      mask_info=dkv_info,
      use_fused_bwd_kernel=cfg.fused_bwd,
      **common,
    )

  def _dq(qb, kb, vb, lb, dob, dib, seg):
    return sk._splash_attention_bwd_dq(  # noqa: SLF001
      qb,
      kb,
      vb,
      seg,
      None,
      lb,
      dob,
      dib,
      bq=sizes.block_q_dq,
      bkv=sizes.block_kv_dq,
      mask_info=dq_info,
      **common,
    )

  if q_seg is None:
    call = jax.vmap(lambda *a: one(*a, None))
    args = (q, k, v, lse, do, di)
  else:
    call = jax.vmap(
      lambda a, b, c, d, e, f, qs, ks: one(a, b, c, d, e, f, segment_ids_for_kernel(qs, ks))
    )
    args = (q, k, v, lse, do, di, q_seg, kv_seg)
  with _kernel_precision(q.dtype):
    g = _outside_vma_check(call, args, (*args, qseq), cfg.interpret)
  return tuple(x.astype(jnp.float32) for x in g)


def _piece(x, i, size: int, axis: int):
  return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def forward_tiled(cfg: SplashCall, q, k, v, q_seg, kv_seg, qseq):
  """`_forward_run` on one kv run, as a loop of pieces when its block maps outgrow
  SMEM: for each q piece, the kv pieces merged through their lse."""
  t, s = q.shape[2], k.shape[2]
  tq, ts = tiles(cfg, t, s)
  if (tq, ts) == (t, s):
    return _forward_run(cfg, q, k, v, q_seg, kv_seg, qseq)
  b, n, vd = q.shape[0], q.shape[1], v.shape[3]
  refs = (q, k, v, q_seg, kv_seg, qseq)

  def q_piece(i, acc):
    qi, qsi, qseqi = _piece(q, i, tq, 2), _piece(q_seg, i, tq, 1), _piece(qseq, i, tq, 0)

    def kv_piece(j, acc_i):
      kj, vj, sj = _piece(k, j, ts, 2), _piece(v, j, ts, 2), _piece(kv_seg, j, ts, 1)
      o, l = _forward_run(cfg, qi, kj, vj, qsi, sj, (qseqi - j * ts).astype(jnp.int32))
      return merge(*acc_i, o, l)

    init = (jnp.zeros((b, n, tq, vd), jnp.float32), jnp.full((b, n, tq), MASKED_LSE, jnp.float32))
    o, l = jax.lax.fori_loop(0, s // ts, kv_piece, tuple(varying_like(x, *refs) for x in init))
    out, lse = acc
    out = jax.lax.dynamic_update_slice_in_dim(out, o, i * tq, axis=2)
    return out, jax.lax.dynamic_update_slice_in_dim(lse, l, i * tq, axis=2)

  init = (jnp.zeros((b, n, t, vd), jnp.float32), jnp.full((b, n, t), MASKED_LSE, jnp.float32))
  out, lse = jax.lax.fori_loop(0, t // tq, q_piece, tuple(varying_like(x, *refs) for x in init))
  # Rows that saw no key in any piece: lse drifted by log 2 per merge; the contract's value.
  return out, jnp.where(lse > VALID_LSE, lse, MASKED_LSE)


def backward_tiled(cfg: SplashCall, q, k, v, q_seg, kv_seg, qseq, lse, do, di, flops=(0, 0)):
  """`_backward_run` on one kv run, as a loop of pieces when its block maps outgrow
  SMEM or (fused) its dq partials outgrow cfg.dq_partial_bytes (`bwd_tiles`):
  for each kv piece, its dk/dv summed over the q pieces, dq accumulated in f32."""
  t, s = q.shape[2], k.shape[2]
  tq, ts = bwd_tiles(cfg, t, s, q_row_bytes(q))
  if (tq, ts) == (t, s):
    return _backward_run(cfg, q, k, v, q_seg, kv_seg, qseq, lse, do, di, flops)
  refs = (q, k, v, q_seg, kv_seg, qseq, lse, do, di)

  def kv_piece(j, acc):
    kj, vj, sj = _piece(k, j, ts, 2), _piece(v, j, ts, 2), _piece(kv_seg, j, ts, 1)

    def q_piece(i, acc_j):
      dq, dkj, dvj = acc_j
      dq_i, dk_i, dv_i = _backward_run(
        cfg,
        _piece(q, i, tq, 2),
        kj,
        vj,
        _piece(q_seg, i, tq, 1),
        sj,
        (_piece(qseq, i, tq, 0) - j * ts).astype(jnp.int32),
        _piece(lse, i, tq, 2),
        _piece(do, i, tq, 2),
        _piece(di, i, tq, 2),
        flops,
      )
      dq = jax.lax.dynamic_update_slice_in_dim(dq, _piece(dq, i, tq, 2) + dq_i, i * tq, axis=2)
      return dq, dkj + dk_i, dvj + dv_i

    dq, dk, dv = acc
    init_j = (dq, jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
    dq, dkj, dvj = jax.lax.fori_loop(
      0, t // tq, q_piece, tuple(varying_like(x, *refs) for x in init_j)
    )
    dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * ts, axis=2)
    return dq, dk, jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * ts, axis=2)

  init = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
  return jax.lax.fori_loop(0, s // ts, kv_piece, tuple(varying_like(x, *refs) for x in init))
