"""TPU splash attention (Pallas), the TPU backend of `lctx.kernels.flash_attention`.

Built on the Pallas kernels of `jax.experimental.pallas.ops.tpu.splash_attention`
(the installed jax; its private forward with `save_residuals` and its dq/dkv
backward kernels, driven by our own custom_vjp so that lse comes out, lse
cotangents go in, and the ring's block backward runs against the GLOBAL out/lse).
Segment ids (packing; 0 = padding, never visible), causal and sliding-window
masks, GQA/MQA (q head n uses kv head n // G inside the kernel: K/V are never
copied), unequal q/k and v head dims (MLA). On the CPU backend the same kernels
run through the Pallas interpreter (interpret=True).

Masks follow the natural token index, described by a `Layout`:

- `TokenOrder(length, zigzag)` (static): the order of the global sequence the
  strategies shard: natural (zigzag=0) or zigzag with ring size Z (2Z chunks of
  length/(2Z) tokens; array slots 2r, 2r+1 hold chunks r and 2Z-1-r, as
  lctx.parallel.zigzag). `natural(p)` maps an array index of that global
  sequence to its natural token index.
- `Layout(order, q_start, kv_start)`: a call's q rows are the global array
  indices q_start + [0, T) and its kv rows kv_start + [0, S); the starts may be
  traced (a device's shard index, a ring step).
- The promise a Layout makes: positions count up by one along the natural index
  inside every segment, and each segment is contiguous in natural order (what
  the data pipeline produces: packed rows, 'absolute' or 'restart' positions).
  Then causality and windows on positions are causality and windows on the
  natural index (segment ids do the rest), and the kernel's masks are exact.
  `layout=None` means the array order is the natural order for both q and kv
  (default positions, or positions_in_order=True).

How the mask reaches the kernel: the block map (data_next / block_mask, per
block: skip, partial, full) is computed at run time from the layout (a few
small integer ops per call, not per element), and the in-kernel mask compares
the q rows' natural index (the kernel's `q_sequence` input, shifted by the kv
run's start) with the kv array index. That needs kv rows contiguous in natural
order, so kv is processed in runs: one run in natural order; a zigzag kv slice
shorter than the sequence is cut at the zigzag chunk boundaries (a visiting
ring block of two chunks: two kernel calls merged through their lse); a kv
holding the whole zigzag sequence (all_gather) is put back in natural order
once (a copy of K/V) and runs as one call.

Long calls are tiled: the block maps are scalar-prefetched whole into the
core's SMEM (1 MiB), so a call whose maps would outgrow `MAX_BLOCK_MAP_BYTES`
(ulysses at 1M tokens per device: 1024 x 1024 blocks, 3 MiB) runs as a loop of
(q piece, kv piece) kernel calls, each piece's map within the budget, merged
through their lse (forward) or summed (backward). Calls within the budget run
as one kernel call, as before.

Blocks: multiples of 128 (TPU lanes) that divide the lengths, at most
`MAX_BLOCK`; the kv compute block at most `MAX_COMPUTE_BLOCK` (VMEM: v5p
compiles of 2048 x 2048 f32 score blocks exceed the 16 MiB scoped VMEM;
1024 x 1024 blocks with 512-wide kv compute compile). Rows that see no key
give out 0 and lse MASKED_LSE, as every lctx kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lctx.kernels import flop_tags
from lctx.kernels.masking import MASKED_LSE, check_shapes, default_scale, normalize_mask_args
from lctx.kernels.shard_typing import cotangent_like, varying_like

LANES = 128
MAX_BLOCK = 1024
MAX_COMPUTE_BLOCK = 512
# Bytes of block maps (data_next + block_mask) one kernel call may prefetch into
# SMEM (1 MiB per core on v5p and TPU7x, libtpu 0.0.42.1). Measured on v5p
# compile-only devices, one call's forward and backward at 1024-token blocks:
# 512 x 512 blocks (768 KiB) compile; 640 x 640 (1.17 MiB) run out of SMEM.
MAX_BLOCK_MAP_BYTES = 768 << 10
_VALID_LSE = -1e29  # any real lse is far above; the kernel gives ~-2.4e38 or -inf for no key


def _sk():
  """The library's kernel module (imported on first use: TPU-only dependencies)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  return sk


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenOrder:
  """Order of the global sequence (static). length: tokens; zigzag: ring size Z
  of the zigzag order (0: natural order)."""

  length: int
  zigzag: int = 0

  def __post_init__(self):
    if self.length < 1 or self.zigzag < 0:
      raise ValueError(f"TokenOrder needs length >= 1 and zigzag >= 0; got {self}")
    if self.zigzag and self.length % (2 * self.zigzag):
      raise ValueError(f"TokenOrder: length {self.length} is not divisible by 2 x {self.zigzag}")

  @property
  def chunk(self) -> int:
    """Tokens of one contiguous natural run of the array order."""
    return self.length // (2 * self.zigzag) if self.zigzag else self.length

  def slots(self) -> np.ndarray:
    """Natural chunk held by each array slot (zigzag: [0, 2Z-1, 1, 2Z-2, ...])."""
    z = self.zigzag
    return np.array([c for r in range(z) for c in (r, 2 * z - 1 - r)] or [0], np.int32)

  def natural(self, p, xp=jnp):
    """Natural token index of global array index p (int32, traced or not; xp=np
    for host arrays)."""
    if not self.zigzag:
      return p
    slot, off = p // self.chunk, p % self.chunk
    r = slot // 2
    return xp.where(slot % 2 == 0, r, 2 * self.zigzag - 1 - r) * self.chunk + off


@functools.partial(
  jax.tree_util.register_dataclass, data_fields=("q_start", "kv_start"), meta_fields=("order",)
)
@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a call's rows sit: q rows are global array indices q_start + [0, T),
  kv rows kv_start + [0, S) of a sequence in `order` (see the module docstring
  for the promise about positions). Starts may be traced int32 scalars."""

  order: TokenOrder
  q_start: object = 0
  kv_start: object = 0


def _kv_run(order: TokenOrder, s: int) -> int:
  """Length of the natural runs a kv slice of s rows is cut into."""
  if not order.zigzag or s == order.length:
    return s
  return min(s, order.chunk)


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
    run = _kv_run(o, s)
    if s % run or run % LANES or (o.zigzag and s < o.length and o.chunk % run):
      return (
        f"kv_len {s} does not cut into zigzag chunks of {o.chunk} tokens in runs that are "
        f"multiples of {LANES}"
      )
  return ""


# ---------------------------------------------------------------------------
# Kernel configuration and the run-time block map
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _MaskFn:
  """In-kernel mask on (q natural index - kv run start, kv index in the run)."""

  causal: bool
  window: int | None

  def __call__(self, q, k):
    vis = q >= k if self.causal else None
    if self.window is not None:
      w = q - k < self.window
      if not self.causal:
        w = w & (k - q < self.window)
      vis = w if vis is None else vis & w
    return vis


@dataclasses.dataclass(frozen=True)
class _Cfg:
  """Static settings of one splash call (hashable: custom_vjp nondiff arg)."""

  causal: bool
  window: int | None
  scale: float
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int
  order: TokenOrder
  interpret: bool

  @property
  def mask_fn(self) -> _MaskFn | None:
    return _MaskFn(self.causal, self.window) if self.causal or self.window is not None else None


def _fit(block: int, n: int) -> int:
  """Largest multiple of LANES that divides n and is at most max(block, LANES)."""
  best = LANES
  for m in range(1, n // LANES + 1):
    b = m * LANES
    if n % b == 0 and b <= max(block, LANES):
      best = b
  return best


def _sizes(cfg: _Cfg, t: int, s: int):
  sk = _sk()
  bq, bk = _fit(min(cfg.block_q, MAX_BLOCK), t), _fit(min(cfg.block_kv, MAX_BLOCK), s)
  gq, gk = _fit(min(cfg.block_q_bwd, MAX_BLOCK), t), _fit(min(cfg.block_kv_bwd, MAX_BLOCK), s)
  return sk.BlockSizes(
    block_q=bq,
    block_kv=bk,
    block_kv_compute=_fit(MAX_COMPUTE_BLOCK, bk),
    block_q_dkv=gq,
    block_kv_dkv=gk,
    block_kv_dkv_compute=_fit(MAX_COMPUTE_BLOCK, gk),
    block_q_dq=gq,
    block_kv_dq=gk,
  )


def _block_classes(cfg: _Cfg, qseq, bq: int, kv_len: int, bkv: int, xp=jnp):
  """`[nq, nk]` int32: 0 = no visible pair (skipped), 1 = partial, 2 = all visible,
  from each q block's min/max natural index (relative to the kv run start).
  xp: jnp, or numpy to evaluate on the host at trace time (FLOP counts)."""
  nq, nk = qseq.shape[0] // bq, kv_len // bkv
  if cfg.mask_fn is None:
    return xp.full((nq, nk), 2, xp.int32)
  qb = qseq.reshape(nq, bq)
  qmin, qmax = qb.min(axis=1)[:, None], qb.max(axis=1)[:, None]
  kmin = (xp.arange(nk, dtype=xp.int32) * bkv)[None, :]
  kmax = kmin + (bkv - 1)
  empty = xp.zeros((nq, nk), bool)
  full = xp.ones((nq, nk), bool)
  if cfg.causal:
    empty = empty | (qmax < kmin)
    full = full & (qmin >= kmax)
  if cfg.window is not None:
    w = cfg.window
    empty = empty | (qmin - kmax >= w)
    full = full & (qmax - kmin < w)
    if not cfg.causal:
      empty = empty | (kmin - qmax >= w)
      full = full & (kmax - qmin < w)
  return xp.where(empty, 0, xp.where(full, 2, 1)).astype(xp.int32)


def _next_live(live_flat, minor: int):
  """Per grid step (flattened in the kernel's iteration order): the minor index of
  the first live step at or after it, wrapping to the first live step (0 if none):
  the block the kernel prefetches, as the library's data_next."""
  n = live_flat.shape[0]
  cand = jnp.where(live_flat, jnp.arange(n, dtype=jnp.int32), n)
  nxt = jax.lax.cummin(cand, reverse=True)
  nxt = jnp.where(nxt == n, jnp.min(cand), nxt)
  return jnp.where(nxt == n, 0, nxt) % minor


def _small_int_type(bound: int):
  """The smallest int type that holds `bound` (scalar memory is scarce)."""
  for dt in (jnp.int8, jnp.int16):
    if bound <= jnp.iinfo(dt).max:
      return jnp.dtype(dt)
  return jnp.dtype(jnp.int32)


def _small_int(x, bound: int):
  """Scalar-memory arrays in the smallest int type that holds `bound`."""
  return x.astype(_small_int_type(bound))


def _mask_info(cfg: _Cfg, qseq, bq: int, kv_len: int, bkv: int, dkv: bool):
  """The kernel's MaskInfo, built at run time (shapes static, values traced)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

  bm = _block_classes(cfg, qseq, bq, kv_len, bkv)
  nq, nk = bm.shape
  if dkv:  # the dkv kernel iterates kv-major and prefetches q blocks
    data_next = _next_live((bm > 0).T.reshape(-1), nq).reshape(nk, nq).T
  else:
    data_next = _next_live((bm > 0).reshape(-1), nk).reshape(nq, nk)
  return mi.MaskInfo(
    data_next=_small_int(data_next, max(nq, nk))[None],
    mask_next=None,
    block_mask=_small_int(bm, 2)[None],
    partial_mask_blocks=None,
    q_sequence=None if cfg.mask_fn is None else qseq,
  )


# ---------------------------------------------------------------------------
# Forward / backward on head-major arrays
# ---------------------------------------------------------------------------


def _segment_ids(q_seg, kv_seg):
  """Kernel segment ids: padding (0) made distinct on each side, so it sees nothing."""
  return _sk().SegmentIds(q=jnp.where(q_seg == 0, -1, q_seg), kv=jnp.where(kv_seg == 0, -2, kv_seg))


def _run_starts(cfg: _Cfg, s: int, kv_start, xp=jnp) -> list[tuple[int, object]]:
  """The kv runs of an s-row kv slice at array index kv_start: [(array offset in
  the slice, natural start)]; each run is `_kv_run` rows (s for a whole zigzag
  sequence, which is put back in natural order as one run)."""
  o = cfg.order
  if o.zigzag and s == o.length:
    return [(0, 0)]
  r = _kv_run(o, s)
  return [(j * r, o.natural(kv_start + j * r, xp)) for j in range(s // r)]


def _runs(cfg: _Cfg, k, v, kv_seg, kv_start):
  """kv `[B, K, S, X]` as runs contiguous in natural order: [(k, v, seg, nat start)]."""
  o, s = cfg.order, k.shape[2]
  if o.zigzag and s == o.length:  # the whole zigzag sequence: natural order, one run
    perm = np.argsort(o.slots())
    k, v = (_permute_chunks(x, perm, o, axis=2) for x in (k, v))
    kv_seg = None if kv_seg is None else _permute_chunks(kv_seg, perm, o, axis=1)
    return [(k, v, kv_seg, 0)]
  r = _kv_run(o, s)
  return [
    (
      k[:, :, a : a + r],
      v[:, :, a : a + r],
      None if kv_seg is None else kv_seg[:, a : a + r],
      start,
    )
    for a, start in _run_starts(cfg, s, kv_start)
  ]


def _permute_chunks(x, perm, order: TokenOrder, axis: int):
  shape = x.shape
  x = x.reshape(shape[:axis] + (len(perm), order.chunk) + shape[axis + 1 :])
  return jnp.take(x, jnp.asarray(perm), axis=axis).reshape(shape)


def _merge(o1, l1, o2, l2):
  lse = jnp.logaddexp(l1, l2)
  w1, w2 = jnp.exp(l1 - lse)[..., None], jnp.exp(l2 - lse)[..., None]
  return o1 * w1 + o2 * w2, lse


def _q_natural_np(cfg: _Cfg, q_start: int, t: int) -> np.ndarray:
  return cfg.order.natural(q_start + np.arange(t, dtype=np.int64), np)


def _q_natural(cfg: _Cfg, q_start, t: int):
  return cfg.order.natural(jnp.asarray(q_start, jnp.int32) + jnp.arange(t, dtype=jnp.int32))


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


def _forward_run(cfg: _Cfg, q, k, v, q_seg, kv_seg, qseq):
  """One kv run: the kernel's forward with residuals, vmapped over the batch."""
  sk = _sk()
  t, s = q.shape[2], k.shape[2]
  sizes = _sizes(cfg, t, s)
  info = _mask_info(cfg, qseq, sizes.block_q, s, sizes.block_kv, dkv=False)

  def one(qb, kb, vb, seg):
    # The library's private forward: save_residuals=True returns the lse, which
    # its public custom_vjp refuses to differentiate; _attention owns the vjp.
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
    call = jax.vmap(lambda a, b, c, d, e: one(a, b, c, _segment_ids(d, e)))
    args = (q, k, v, q_seg, kv_seg)
  with _kernel_precision(q.dtype):
    o, (lse,) = _outside_vma_check(call, args, (*args, qseq), cfg.interpret)
  seen = lse > _VALID_LSE
  o = jnp.where(seen[..., None], o.astype(jnp.float32), 0.0)
  return o, jnp.where(seen, lse, MASKED_LSE)


def _backward_run(cfg: _Cfg, q, k, v, q_seg, kv_seg, qseq, lse, do, di, flops=(0, 0)):
  """One kv run: the kernel's dkv and dq passes, vmapped over the batch."""
  sk = _sk()
  t, s = q.shape[2], k.shape[2]
  sizes = _sizes(cfg, t, s)
  dkv_info = _mask_info(cfg, qseq, sizes.block_q_dkv, s, sizes.block_kv_dkv, dkv=True)
  dq_info = _mask_info(cfg, qseq, sizes.block_q_dq, s, sizes.block_kv_dq, dkv=False)
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
    with flop_tags.flops_scope(flops[0]):
      dkv = _dkv(qb, kb, vb, lb, dob, dib, seg)
    with flop_tags.flops_scope(flops[1]):
      dq = _dq(qb, kb, vb, lb, dob, dib, seg)
    return dq, *dkv

  def _dkv(qb, kb, vb, lb, dob, dib, seg):
    _, dk, dv = sk._splash_attention_bwd_dkv(  # noqa: SLF001
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
      use_fused_bwd_kernel=False,
      **common,
    )
    return dk, dv

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
    call = jax.vmap(lambda a, b, c, d, e, f, qs, ks: one(a, b, c, d, e, f, _segment_ids(qs, ks)))
    args = (q, k, v, lse, do, di, q_seg, kv_seg)
  with _kernel_precision(q.dtype):
    g = _outside_vma_check(call, args, (*args, qseq), cfg.interpret)
  return tuple(x.astype(jnp.float32) for x in g)


def _map_bytes(nq: int, nk: int) -> int:
  """SMEM bytes of one call's block maps, as `_mask_info` makes them: data_next in
  the type that holds max(nq, nk), block_mask in the type that holds 2."""
  itemsize = _small_int_type(max(nq, nk)).itemsize + _small_int_type(2).itemsize
  return nq * nk * itemsize


def _block_map_bytes(cfg: _Cfg, t: int, s: int) -> int:
  """The largest block-map footprint of the forward, dkv and dq calls on (t, s)."""
  z = _sizes(cfg, t, s)
  pairs = ((z.block_q, z.block_kv), (z.block_q_dkv, z.block_kv_dkv), (z.block_q_dq, z.block_kv_dq))
  return max(_map_bytes(t // bq, s // bk) for bq, bk in pairs)


def _shorter_piece(n: int, piece: int) -> int:
  """The longest piece shorter than `piece` that cuts n evenly into multiples of
  LANES (`piece` itself if there is none)."""
  for m in range(n // piece + 1, n // LANES + 1):
    if n % m == 0 and (n // m) % LANES == 0:
      return n // m
  return piece


def _tiles(cfg: _Cfg, t: int, s: int) -> tuple[int, int]:
  """(q piece, kv piece) lengths whose block maps fit MAX_BLOCK_MAP_BYTES: (t, s)
  when the whole call fits, else shorter pieces, the longer side cut first."""
  tq, ts = t, s
  while _block_map_bytes(cfg, tq, ts) > MAX_BLOCK_MAP_BYTES:
    shorter_q, shorter_s = _shorter_piece(t, tq), _shorter_piece(s, ts)
    if shorter_q != tq and (tq >= ts or shorter_s == ts):
      tq = shorter_q
    elif shorter_s != ts:
      ts = shorter_s
    else:
      break  # single-lane pieces: nothing shorter
  return tq, ts


def _piece(x, i, size: int, axis: int):
  return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def _forward_tiled(cfg: _Cfg, q, k, v, q_seg, kv_seg, qseq):
  """`_forward_run` on one kv run, as a loop of pieces when its block maps outgrow
  SMEM: for each q piece, the kv pieces merged through their lse."""
  t, s = q.shape[2], k.shape[2]
  tq, ts = _tiles(cfg, t, s)
  if (tq, ts) == (t, s):
    return _forward_run(cfg, q, k, v, q_seg, kv_seg, qseq)
  b, n, vd = q.shape[0], q.shape[1], v.shape[3]
  refs = (q, k, v, q_seg, kv_seg, qseq)

  def q_piece(i, acc):
    qi, qsi, qseqi = _piece(q, i, tq, 2), _piece(q_seg, i, tq, 1), _piece(qseq, i, tq, 0)

    def kv_piece(j, acc_i):
      kj, vj, sj = _piece(k, j, ts, 2), _piece(v, j, ts, 2), _piece(kv_seg, j, ts, 1)
      o, l = _forward_run(cfg, qi, kj, vj, qsi, sj, (qseqi - j * ts).astype(jnp.int32))
      return _merge(*acc_i, o, l)

    init = (jnp.zeros((b, n, tq, vd), jnp.float32), jnp.full((b, n, tq), MASKED_LSE, jnp.float32))
    o, l = jax.lax.fori_loop(0, s // ts, kv_piece, tuple(varying_like(x, *refs) for x in init))
    out, lse = acc
    out = jax.lax.dynamic_update_slice_in_dim(out, o, i * tq, axis=2)
    return out, jax.lax.dynamic_update_slice_in_dim(lse, l, i * tq, axis=2)

  init = (jnp.zeros((b, n, t, vd), jnp.float32), jnp.full((b, n, t), MASKED_LSE, jnp.float32))
  out, lse = jax.lax.fori_loop(0, t // tq, q_piece, tuple(varying_like(x, *refs) for x in init))
  # Rows that saw no key in any piece: lse drifted by log 2 per merge; the contract's value.
  return out, jnp.where(lse > _VALID_LSE, lse, MASKED_LSE)


def _backward_tiled(cfg: _Cfg, q, k, v, q_seg, kv_seg, qseq, lse, do, di, flops=(0, 0)):
  """`_backward_run` on one kv run, as a loop of pieces when its block maps outgrow
  SMEM: for each kv piece, its dk/dv summed over the q pieces, dq accumulated."""
  t, s = q.shape[2], k.shape[2]
  tq, ts = _tiles(cfg, t, s)
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


# ---------------------------------------------------------------------------
# FLOPs per kernel call, from the block maps the calls build (flop_tags.py)
# ---------------------------------------------------------------------------
_MAX_START_PAIRS = 256  # (q start, kv start) pairs averaged over when they are traced


def _possible_starts(start, length: int, order: TokenOrder) -> list[int]:
  """A start's value, or (traced: a device's shard, a ring step) every multiple
  of the call's length in the sequence, at most 16 of them evenly spaced."""
  value = flop_tags.known(start)
  if value is not None:
    return [int(value)]
  starts = list(range(0, order.length - length + 1, length)) or [0]
  if len(starts) * len(starts) > _MAX_START_PAIRS:
    starts = [starts[i] for i in np.linspace(0, len(starts) - 1, 16).round().astype(int)]
  return starts


def _call_flops(cfg: _Cfg, q, k, v, q_start, kv_start, passes) -> list[float]:
  """Per pass ((block_q, block_kv, FLOPs per pair) of `_sizes` names), the FLOPs of
  one kernel call of a `_forward` / `_backward` on head-major q, k, v: the live
  blocks of the maps `_block_classes` builds, over all runs and pieces, divided
  by the calls made; traced starts averaged over their possible values."""
  b, n, t, _ = q.shape
  s = k.shape[2]
  totals, calls, samples = [0.0] * len(passes), 0, 0
  for qs in _possible_starts(q_start, t, cfg.order):
    qnat = _q_natural_np(cfg, qs, t)
    for ks in _possible_starts(kv_start, s, cfg.order):
      samples += 1
      calls, r = 0, _kv_run(cfg.order, s)
      for _, nat in _run_starts(cfg, s, ks, xp=np):
        tq, ts = _tiles(cfg, t, r)
        calls += (t // tq) * (r // ts)
        sizes = _sizes(cfg, tq, ts)
        qseq = qnat - int(nat)
        for i, (bq_name, bk_name, per_pair) in enumerate(passes):
          bq, bk = getattr(sizes, bq_name), getattr(sizes, bk_name)
          live = _block_classes(cfg, qseq, bq, r, bk, xp=np) > 0
          totals[i] += b * n * flop_tags.block_pairs(live, t, r, bq, bk) * per_pair
  return [x / samples / max(calls, 1) for x in totals]


def _forward(cfg: _Cfg, q, k, v, q_seg, kv_seg, q_start, kv_start):
  """q `[B, N, T, H]` (already scaled), k `[B, K, S, H]`, v `[B, K, S, V]`, segment
  ids `[B, T]` / `[B, S]` or None. Returns out `[B, N, T, V]` f32 and lse `[B, N, T]`
  (runs merged through their lse)."""
  h, vd = q.shape[3], v.shape[3]
  (fwd,) = _call_flops(
    cfg, q, k, v, q_start, kv_start, [("block_q", "block_kv", flop_tags.forward_pair_flops(h, vd))]
  )
  qnat = _q_natural(cfg, q_start, q.shape[2])
  out = lse = None
  with flop_tags.flops_scope(fwd):
    for kr, vr, sr, start in _runs(cfg, k, v, kv_seg, kv_start):
      o, l = _forward_tiled(cfg, q, kr, vr, q_seg, sr, (qnat - start).astype(jnp.int32))
      out, lse = (o, l) if out is None else _merge(out, lse, o, l)
  return out, lse


def _backward(cfg: _Cfg, q, k, v, q_seg, kv_seg, q_start, kv_start, out, lse, dout, dlse):
  """FA2 backward against the GLOBAL out `[B, N, T, V]` / lse `[B, N, T]` (and an lse
  cotangent dlse or None). Returns dq (w.r.t. the scaled q), dk, dv, float32."""
  qnat = _q_natural(cfg, q_start, q.shape[2])
  # delta = rowsum(dout * out) - dlse: the lse cotangent enters the FA2 backward here.
  di = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
  if dlse is not None:
    di = di - dlse.astype(jnp.float32)
  do = dout.astype(v.dtype)
  h, vd = q.shape[3], v.shape[3]
  flops = _call_flops(
    cfg,
    q,
    k,
    v,
    q_start,
    kv_start,
    [
      ("block_q_dkv", "block_kv_dkv", flop_tags.splash_dkv_pair_flops(h, vd)),
      ("block_q_dq", "block_kv_dq", flop_tags.splash_dq_pair_flops(h, vd)),
    ],
  )
  dq, dks, dvs = None, [], []
  for kr, vr, sr, start in _runs(cfg, k, v, kv_seg, kv_start):
    qseq = (qnat - start).astype(jnp.int32)
    dq_r, dk_r, dv_r = _backward_tiled(cfg, q, kr, vr, q_seg, sr, qseq, lse, do, di, flops=flops)
    dq = dq_r if dq is None else dq + dq_r
    dks.append(dk_r)
    dvs.append(dv_r)
  dk, dv = (jnp.concatenate(x, axis=2) if len(x) > 1 else x[0] for x in (dks, dvs))
  o = cfg.order
  if o.zigzag and k.shape[2] == o.length:  # back from natural to zigzag order
    dk, dv = (_permute_chunks(x, o.slots(), o, axis=2) for x in (dk, dv))
  return dq, dk, dv


# ---------------------------------------------------------------------------
# Public entry points ([B, T, N, H] layout, as every lctx kernel)
# ---------------------------------------------------------------------------


def _head_major(q, k, v, scale):
  qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
  return qs.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _config(q, k, causal, window_size, softmax_scale, blocks, layout, interpret) -> _Cfg:
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  del b
  order = layout.order if layout is not None else TokenOrder(max(t, s))
  bq, bk, gq, gk = blocks
  return _Cfg(
    causal=bool(causal),
    window=None if window_size is None else int(window_size),
    scale=default_scale(q.shape[-1], softmax_scale),
    block_q=int(bq),
    block_kv=int(bk),
    block_q_bwd=int(gq or bq),
    block_kv_bwd=int(gk or bk),
    order=order,
    interpret=bool(interpret),
  )


def _starts(layout):
  if layout is None:
    return jnp.int32(0), jnp.int32(0)
  return jnp.asarray(layout.q_start, jnp.int32), jnp.asarray(layout.kv_start, jnp.int32)


def _check(q, k, v, positions_given, layout):
  why = unsupported(q, k, v, positions_given=positions_given, layout=layout)
  if why:
    raise ValueError(f"backend='splash': {why}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, q_seg, kv_seg, q_start, kv_start):
  out, lse = _attention_fwd(cfg, q, k, v, q_seg, kv_seg, q_start, kv_start)[0]
  return out, lse


def _attention_fwd(cfg, q, k, v, q_seg, kv_seg, q_start, kv_start):
  qh, kh, vh = _head_major(q, k, v, cfg.scale)
  out, lse = _forward(cfg, qh, kh, vh, q_seg, kv_seg, q_start, kv_start)
  out = out.astype(q.dtype)
  return (out.transpose(0, 2, 1, 3), lse), (q, k, v, q_seg, kv_seg, q_start, kv_start, out, lse)


def _attention_bwd(cfg, res, cts):
  q, k, v, q_seg, kv_seg, q_start, kv_start, out, lse = res
  dout, dlse = cts
  qh, kh, vh = _head_major(q, k, v, cfg.scale)
  dq, dk, dv = _backward(
    cfg, qh, kh, vh, q_seg, kv_seg, q_start, kv_start, out, lse, dout.transpose(0, 2, 1, 3), dlse
  )
  # Typed like their primals inside shard_map (e.g. K/V replicated over tensor
  # for MQA while q is sharded there: summed over it).
  refs = (q, k, v, dout)
  dq = cotangent_like((dq * cfg.scale).transpose(0, 2, 1, 3), q, *refs).astype(q.dtype)
  dk = cotangent_like(dk.transpose(0, 2, 1, 3), k, *refs).astype(k.dtype)
  dv = cotangent_like(dv.transpose(0, 2, 1, 3), v, *refs).astype(v.dtype)
  return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def splash_attention(
  q,
  k,
  v,
  *,
  segment_ids=None,
  causal=True,
  window_size=None,
  softmax_scale=None,
  return_lse=False,
  block_q=512,
  block_kv=512,
  block_q_bwd=None,
  block_kv_bwd=None,
  layout: Layout | None = None,
  positions_given: bool = False,
  interpret=False,
):
  """Splash attention, differentiable in q, k, v (and through lse).

  q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`; segment_ids `[B, T]` or a
  (q_ids, kv_ids) pair (0 = padding); masks on the natural token index of
  `layout` (None: array order for both). Returns out `[B, T, N, V]` (and lse
  `[B, N, T]` float32 if return_lse). interpret: run through the Pallas
  interpreter (any backend). Raises ValueError when the call cannot take the
  kernel (see `unsupported`; positions_given: the caller passed explicit
  positions that only a layout makes usable).
  """
  _check(q, k, v, positions_given, layout)
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  mask = normalize_mask_args(b, t, s, segment_ids, window_size=window_size)
  cfg = _config(
    q,
    k,
    causal,
    window_size,
    softmax_scale,
    (block_q, block_kv, block_q_bwd, block_kv_bwd),
    layout,
    interpret,
  )
  out, lse = _attention(cfg, q, k, v, mask.q_segment_ids, mask.kv_segment_ids, *_starts(layout))
  return (out, lse) if return_lse else out


def splash_block_forward(
  q,
  k,
  v,
  *,
  q_segment_ids,
  kv_segment_ids,
  causal,
  window_size,
  softmax_scale,
  block_q,
  block_kv,
  layout: Layout | None = None,
  positions_given: bool = False,
  interpret=False,
):
  """One (visiting) K/V block for the ring: out `[B, T, N, V]` float32 normalised
  within the block, lse `[B, N, T]` (MASKED_LSE and out 0 where a row sees no key
  of the block). Not differentiable by itself (see splash_block_backward)."""
  _check(q, k, v, positions_given, layout)
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  mask = normalize_mask_args(b, t, s, seg, window_size=window_size)
  cfg = _config(
    q, k, causal, window_size, softmax_scale, (block_q, block_kv, None, None), layout, interpret
  )
  qh, kh, vh = _head_major(q, k, v, cfg.scale)
  out, lse = _forward(cfg, qh, kh, vh, mask.q_segment_ids, mask.kv_segment_ids, *_starts(layout))
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
  causal,
  window_size,
  softmax_scale,
  block_q,
  block_kv,
  layout: Layout | None = None,
  positions_given: bool = False,
  interpret=False,
):
  """FA2 backward of one K/V block against the GLOBAL out `[B, T, N, V]` and lse
  `[B, N, T]`; dout its cotangent. Returns (dq, dk, dv) float32."""
  _check(q, k, v, positions_given, layout)
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  mask = normalize_mask_args(b, t, s, seg, window_size=window_size)
  cfg = _config(
    q, k, causal, window_size, softmax_scale, (block_q, block_kv, None, None), layout, interpret
  )
  qh, kh, vh = _head_major(q, k, v, cfg.scale)
  dq, dk, dv = _backward(
    cfg,
    qh,
    kh,
    vh,
    mask.q_segment_ids,
    mask.kv_segment_ids,
    *_starts(layout),
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
