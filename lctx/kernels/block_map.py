"""Run-time block map: which (q-block, kv-block) pairs are dead, partial or full.

Segment ids and positions are data, so the map is derived at run time from the
per-block min/max of positions and (non-padding) segment ids:

- dead: no query of the q block can see any key of the kv block (causality,
  window, or disjoint document ranges). Never computed.
- full: every query sees every key. Computed without a mask.
- partial: anything else. Computed with the element mask.

The test is conservative (a block judged live may still be fully masked by its
element mask), so the result is always exact; it is tight for contiguous
documents and for contiguous, possibly reordered, position runs (zigzag, ring).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


class BlockStats(NamedTuple):
  """Per-block summaries, each `[n_blocks]` int32."""

  pos_min: jnp.ndarray
  pos_max: jnp.ndarray
  seg_min: jnp.ndarray | None  # raw min (0 if the block has padding)
  seg_max: jnp.ndarray | None
  seg_min_nz: jnp.ndarray | None  # min over non-padding ids (_BIG if none)
  seg_max_nz: jnp.ndarray | None  # max over non-padding ids (0 if none)


def block_stats(pos: jnp.ndarray, seg: jnp.ndarray | None, xp=jnp) -> BlockStats:
  """pos, seg: `[n_blocks, block]` int32 (seg may be None). xp: jnp, or numpy to
  evaluate on the host at trace time (FLOP counts, flop_tags.py)."""
  pmin, pmax = xp.min(pos, axis=1), xp.max(pos, axis=1)
  if seg is None:
    return BlockStats(pmin, pmax, None, None, None, None)
  nz = seg != 0
  return BlockStats(
    pmin,
    pmax,
    xp.min(seg, axis=1),
    xp.max(seg, axis=1),
    xp.min(xp.where(nz, seg, _BIG), axis=1),
    xp.max(xp.where(nz, seg, 0), axis=1),
  )


def block_map(qs: BlockStats, ks: BlockStats, causal: bool, window_size, xp=jnp):
  """Returns (live, full), bool `[n_q_blocks, n_kv_blocks]`; full implies live."""
  qmin, qmax = qs.pos_min[:, None], qs.pos_max[:, None]
  kmin, kmax = ks.pos_min[None, :], ks.pos_max[None, :]
  live = xp.ones((qmin.shape[0], kmin.shape[1]), dtype=bool)
  full = live
  if qs.seg_min is not None:
    # Ranges of real (non-padding) document ids must intersect; an all-padding
    # block has an empty range and is dead against everything.
    live = (
      live
      & (qs.seg_min_nz[:, None] <= ks.seg_max_nz[None, :])
      & (ks.seg_min_nz[None, :] <= qs.seg_max_nz[:, None])
    )
    one_doc_q = (qs.seg_min == qs.seg_max) & (qs.seg_min != 0)
    one_doc_k = (ks.seg_min == ks.seg_max) & (ks.seg_min != 0)
    full = (
      full & one_doc_q[:, None] & one_doc_k[None, :] & (qs.seg_min[:, None] == ks.seg_min[None, :])
    )
  if causal:
    live = live & (kmin <= qmax)
    full = full & (kmax <= qmin)
  if window_size is not None:
    w = int(window_size)
    # Visible iff kp > qp - w (and kp < qp + w when not causal). Differences
    # are taken in int32; positions are far below 2^30 in practice.
    live = live & (kmax > qmin - w)
    full = full & (kmin > qmax - w)
    if not causal:
      live = live & (kmin < qmax + w)
      full = full & (kmax < qmin + w)
  return live, full & live


def compact_lists(live: jnp.ndarray):
  """For each row of live `[R, C]`: column indices of live entries first (in
  increasing order), then the dead ones; and the live count `[R]`."""
  order = jnp.argsort(jnp.logical_not(live), axis=1, stable=True).astype(jnp.int32)
  return order, jnp.sum(live, axis=1, dtype=jnp.int32)
