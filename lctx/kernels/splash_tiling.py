"""Splash's per-call settings, its run-time block maps and their SMEM tiling.

- `SplashCall`: the static settings of one splash call, resolved from the
  `AttentionOptions` and the call's shapes and layout (hashable: a custom_vjp
  nondiff argument).
- Block maps: per (q block, kv block), skip / partial / full (`block_classes`),
  computed at run time from the layout (a few small integer ops per call, not
  per element), and the kernel's `MaskInfo` built from them (`mask_info`). The
  in-kernel mask (`MaskFn`) compares the q rows' natural index (shifted by the
  kv run's start) with the kv index in the run, so kv is processed in runs
  contiguous in natural order (`kv_run`, `run_starts`).
- SMEM tiling: the block maps are scalar-prefetched whole into the core's SMEM,
  so a call whose maps would outgrow `SplashCall.map_budget` runs as (q piece,
  kv piece) calls, each piece's maps within it (`tiles`).
- FLOPs per kernel call, from the same maps (`call_flops`, for flop_tags.py).

Blocks: multiples of LANES that divide the lengths, at most MAX_BLOCK; the kv
compute block at most MAX_COMPUTE_BLOCK, which keeps one f32 score block inside
the scoped VMEM (docs/benchmarks.md has the compiles that bound both).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lctx.kernels import flop_tags
from lctx.kernels.masking import default_scale
from lctx.kernels.options import AttentionOptions
from lctx.kernels.token_order import Layout, TokenOrder

LANES = 128  # TPU lanes: the unit of every block and piece
MAX_BLOCK = 1024
MAX_COMPUTE_BLOCK = 512
# Bytes of block maps (data_next + block_mask) one kernel call may prefetch into
# SMEM: the core has 1 MiB, and the kernel's own scalars need the rest
# (docs/benchmarks.md: the largest map that compiles on v5p).
MAX_BLOCK_MAP_BYTES = 768 << 10


def library():
  """The library's kernel module (imported on first use: TPU-only dependencies)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

  return sk


@dataclasses.dataclass(frozen=True)
class MaskFn:
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
class SplashCall:
  """Static settings of one splash call (hashable: custom_vjp nondiff arg); made by
  `call_config`."""

  causal: bool
  window: int | None
  scale: float
  block_q: int
  block_kv: int
  block_q_bwd: int
  block_kv_bwd: int
  order: TokenOrder
  interpret: bool
  map_budget: int = MAX_BLOCK_MAP_BYTES  # SMEM bytes of block maps per kernel call
  fused_bwd: bool = True  # the library's fused dq+dkv backward kernel
  dq_partial_bytes: int = 1 << 30  # HBM bytes of dq partials per fused call

  @property
  def mask_fn(self) -> MaskFn | None:
    return MaskFn(self.causal, self.window) if self.causal or self.window is not None else None


def call_config(
  q, k, options: AttentionOptions, layout: Layout | None, interpret: bool, map_budget: int
) -> SplashCall:
  """The settings of one call on q `[B, T, N, H]`, k `[B, S, K, H]`."""
  t, s = q.shape[1], k.shape[1]
  return SplashCall(
    causal=options.causal,
    window=options.window_size,
    scale=default_scale(q.shape[-1], options.softmax_scale),
    block_q=options.block_q,
    block_kv=options.block_kv,
    block_q_bwd=options.block_q_bwd or options.block_q,
    block_kv_bwd=options.block_kv_bwd or options.block_kv,
    order=layout.order if layout is not None else TokenOrder(max(t, s)),
    interpret=bool(interpret),
    map_budget=int(map_budget),
    fused_bwd=options.fused_bwd,
    dq_partial_bytes=options.dq_partial_bytes,
  )


def _fit(block: int, n: int) -> int:
  """Largest multiple of LANES that divides n and is at most max(block, LANES)."""
  best = LANES
  for m in range(1, n // LANES + 1):
    b = m * LANES
    if n % b == 0 and b <= max(block, LANES):
      best = b
  return best


def block_sizes(cfg: SplashCall, t: int, s: int):
  sk = library()
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


def block_classes(cfg: SplashCall, qseq, bq: int, kv_len: int, bkv: int, xp=jnp):
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


def mask_info(cfg: SplashCall, qseq, bq: int, kv_len: int, bkv: int, dkv: bool):
  """The kernel's MaskInfo, built at run time (shapes static, values traced)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

  bm = block_classes(cfg, qseq, bq, kv_len, bkv)
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


def kv_run(order: TokenOrder, s: int) -> int:
  """Length of the natural runs a kv slice of s rows is cut into."""
  if not order.zigzag or s == order.length:
    return s
  return min(s, order.chunk)


def run_starts(cfg: SplashCall, s: int, kv_start, xp=jnp) -> list[tuple[int, object]]:
  """The kv runs of an s-row kv slice at array index kv_start: [(array offset in
  the slice, natural start)]; each run is `kv_run` rows (s for a whole zigzag
  sequence, which is put back in natural order as one run)."""
  o = cfg.order
  if o.zigzag and s == o.length:
    return [(0, 0)]
  r = kv_run(o, s)
  return [(j * r, o.natural(kv_start + j * r, xp)) for j in range(s // r)]


def _q_natural_np(cfg: SplashCall, q_start: int, t: int) -> np.ndarray:
  return cfg.order.natural(q_start + np.arange(t, dtype=np.int64), np)


def q_natural(cfg: SplashCall, q_start, t: int):
  return cfg.order.natural(jnp.asarray(q_start, jnp.int32) + jnp.arange(t, dtype=jnp.int32))


def _map_bytes(nq: int, nk: int) -> int:
  """SMEM bytes of one call's block maps, as `mask_info` makes them: data_next in
  the type that holds max(nq, nk), block_mask in the type that holds 2."""
  itemsize = _small_int_type(max(nq, nk)).itemsize + _small_int_type(2).itemsize
  return nq * nk * itemsize


def block_map_bytes(cfg: SplashCall, t: int, s: int) -> int:
  """The largest block-map footprint of the forward, dkv and dq calls on (t, s)."""
  z = block_sizes(cfg, t, s)
  pairs = ((z.block_q, z.block_kv), (z.block_q_dkv, z.block_kv_dkv), (z.block_q_dq, z.block_kv_dq))
  return max(_map_bytes(t // bq, s // bk) for bq, bk in pairs)


def _shorter_piece(n: int, piece: int) -> int:
  """The longest piece shorter than `piece` that cuts n evenly into multiples of
  LANES (`piece` itself if there is none)."""
  for m in range(n // piece + 1, n // LANES + 1):
    if n % m == 0 and (n // m) % LANES == 0:
      return n // m
  return piece


def tiles(cfg: SplashCall, t: int, s: int) -> tuple[int, int]:
  """(q piece, kv piece) lengths whose block maps fit cfg.map_budget: (t, s)
  when the whole call fits, else shorter pieces, the longer side cut first."""
  tq, ts = t, s
  while block_map_bytes(cfg, tq, ts) > cfg.map_budget:
    shorter_q, shorter_s = _shorter_piece(t, tq), _shorter_piece(s, ts)
    if shorter_q != tq and (tq >= ts or shorter_s == ts):
      tq = shorter_q
    elif shorter_s != ts:
      ts = shorter_s
    else:
      break  # single-lane pieces: nothing shorter
  return tq, ts


def dq_partials_bytes(cfg: SplashCall, tq: int, ts: int, q_row_bytes: int) -> int:
  """Bytes of the dq partials a fused backward call on a (tq, ts) piece writes:
  [ts / block_kv_dkv, *q piece] in q's dtype (q_row_bytes: one q row over the
  call's batch and heads)."""
  return (ts // block_sizes(cfg, tq, ts).block_kv_dkv) * tq * q_row_bytes


def bwd_tiles(cfg: SplashCall, t: int, s: int, q_row_bytes: int) -> tuple[int, int]:
  """(q piece, kv piece) of the backward: `tiles`, and with the fused kernel
  cut further until its dq partials fit cfg.dq_partial_bytes: kv first (fewer
  kv blocks per call), then q, down to one lane-wide piece."""
  tq, ts = tiles(cfg, t, s)
  if not cfg.fused_bwd:
    return tq, ts
  while dq_partials_bytes(cfg, tq, ts, q_row_bytes) > cfg.dq_partial_bytes:
    shorter_s, shorter_q = _shorter_piece(s, ts), _shorter_piece(t, tq)
    if shorter_s != ts and ts // block_sizes(cfg, tq, ts).block_kv_dkv > 1:
      ts = shorter_s
    elif shorter_q != tq:
      tq = shorter_q
    else:
      break  # single-lane pieces: nothing shorter
  return tq, ts


def q_row_bytes(q) -> int:
  """Bytes of one q row of a head-major q `[B, N, T, H]` over its batch and heads."""
  b, n, _, h = q.shape
  return b * n * h * jnp.dtype(q.dtype).itemsize


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


def call_flops(
  cfg: SplashCall, q, k, v, q_start, kv_start, passes, backward: bool = False
) -> list[float]:
  """Per pass ((block_q, block_kv, FLOPs per pair) of `block_sizes` names), the FLOPs of
  one kernel call of a `forward` / `backward` on head-major q, k, v: the live
  blocks of the maps `block_classes` builds, over all runs and pieces, divided
  by the calls made (the backward's pieces: `bwd_tiles`); traced starts
  averaged over their possible values."""
  b, n, t, _ = q.shape
  s = k.shape[2]
  totals, calls, samples = [0.0] * len(passes), 0, 0
  for qs in _possible_starts(q_start, t, cfg.order):
    qnat = _q_natural_np(cfg, qs, t)
    for ks in _possible_starts(kv_start, s, cfg.order):
      samples += 1
      calls, r = 0, kv_run(cfg.order, s)
      for _, nat in run_starts(cfg, s, ks, xp=np):
        tq, ts = bwd_tiles(cfg, t, r, q_row_bytes(q)) if backward else tiles(cfg, t, r)
        calls += (t // tq) * (r // ts)
        sizes = block_sizes(cfg, tq, ts)
        qseq = qnat - int(nat)
        for i, (bq_name, bk_name, per_pair) in enumerate(passes):
          bq, bk = getattr(sizes, bq_name), getattr(sizes, bk_name)
          live = block_classes(cfg, qseq, bq, r, bk, xp=np) > 0
          totals[i] += b * n * flop_tags.block_pairs(live, t, r, bq, bk) * per_pair
  return [x / samples / max(calls, 1) for x in totals]
