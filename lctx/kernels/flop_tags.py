"""What an attention kernel computes, written into the names of its HLO ops.

A compiled program hides attention's work from an HLO reader in two ways: the
fused kernels (splash's Mosaic calls, cuDNN's `__cudnn$fmha*`, the CPU kernel's
FFI call) are opaque custom calls, and the blockwise kernel loops over the live
kv blocks of each q block with a trip count known only at run time. Each kernel
therefore states, at trace time, what its own block map makes it compute, as
name scopes that XLA keeps in every op's `metadata={op_name=...}`:

- `lctx_attention`: every op of an attention call (so that an HLO reader can
  tell attention matmuls from the dense ones); `lctx_linear` likewise for a
  linear-attention layer's conv and delta rule (LINEAR_SCOPE);
- `lctx_flops=N`: each kernel custom call made inside computes N FLOPs (the
  innermost tag holds); `lctx_bwd_flops=N` the same for the backward custom
  calls a library emits under the forward's scope (cuDNN's);
- `lctx_trips=X`: a `while` loop inside runs X times on average (the blockwise
  kernel's live-block loops).

lctx/sizing/hlo_flops.py reads them and multiplies them through the program's loop trip
counts like any matmul (so a layer scan, a ring loop or a rematerialised forward
counts each call as often as it runs). The counts come from the kernel's own
block map on the mask inputs known at trace time: causality, windows, block
sizes and (for splash) the token layout. Segment ids and positions of a batch
are data: a traced batch is counted as one document in natural positions. For
splash that is exact (its block map does not see segments); for the blockwise and
CPU kernels, which skip cross-document blocks at run time, it is the upper bound.

FLOPs per visible (query, key) pair of a computed block and q head, with H the
q/k head dim and V the value head dim (2 per multiply-add):
  forward: QK^T 2H + PV 2V;
  FA2 backward in one pass (blockwise, CPU, splash's fused kernel): S 2H, dP 2V,
    dV 2V, dQ 2H, dK 2H;
  splash's two-pass form (AttentionOptions.fused_bwd=False): its dkv pass: S 2H, dP 2V, dV 2V, dK 2H; its dq pass: S 2H, dP 2V, dQ 2H.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np

from lctx.kernels.block_map import block_map, block_stats

ATTENTION_SCOPE = "lctx_attention"
# Every op of a linear-attention layer's sequence work (its short convs and delta
# rule, with their context-parallel halos and state exchange): hlo_flops reports
# their matmuls and collectives apart (they stay in the dense figure).
LINEAR_SCOPE = "lctx_linear"
FLOPS_TAG = "lctx_flops="
BWD_FLOPS_TAG = "lctx_bwd_flops="
TRIPS_TAG = "lctx_trips="


def forward_pair_flops(h: int, v: int) -> int:
  return 2 * h + 2 * v


def fa2_backward_pair_flops(h: int, v: int) -> int:
  return 6 * h + 4 * v


def splash_dkv_pair_flops(h: int, v: int) -> int:
  return 4 * h + 4 * v


def splash_dq_pair_flops(h: int, v: int) -> int:
  return 4 * h + 2 * v


def attention_scope():
  return jax.named_scope(ATTENTION_SCOPE)


def linear_scope():
  return jax.named_scope(LINEAR_SCOPE)


def in_attention_scope(fn):
  """Runs fn (an attention entry point) inside `attention_scope`."""

  @functools.wraps(fn)
  def scoped(*args, **kwargs):
    with attention_scope():
      return fn(*args, **kwargs)

  return scoped


def flops_scope(flops: float, bwd_flops: float | None = None):
  """Tags the kernel custom calls made inside: each computes `flops` FLOPs (and
  each backward call a library emits under this scope, `bwd_flops`)."""
  stack = contextlib.ExitStack()
  stack.enter_context(jax.named_scope(f"{FLOPS_TAG}{int(round(flops))}"))
  if bwd_flops is not None:
    stack.enter_context(jax.named_scope(f"{BWD_FLOPS_TAG}{int(round(bwd_flops))}"))
  return stack


def trips_scope(mean_trips: float):
  """Tags the while loops made inside with their mean trip count."""
  return jax.named_scope(f"{TRIPS_TAG}{float(mean_trips):.6g}")


def natural_positions(batch: int, length: int) -> np.ndarray:
  return np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))


def known(x) -> np.ndarray | None:
  """x as a numpy array when its value is known at trace time, else None."""
  if x is None or isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return None


def known_mask(segment_ids, q_positions, kv_positions):
  """The mask inputs whose values are known at trace time (the others None: one
  document, natural positions)."""
  if isinstance(segment_ids, (tuple, list)):
    seg = tuple(known(x) for x in segment_ids)
    seg = None if any(x is None for x in seg) else seg
  else:
    seg = known(segment_ids)
  return seg, known(q_positions), known(kv_positions)


def block_pairs(live: np.ndarray, t: int, s: int, bq: int, bk: int) -> float:
  """(query, key) pairs computed in the live blocks of a `[..., nq, nk]` map over t
  queries and s keys in blocks of bq x bk; the last block of a side may be short
  (the kernel computes it at that size); summed over the leading dims."""
  nq, nk = live.shape[-2:]
  rows = np.minimum(bq, t - bq * np.arange(nq)).clip(min=0)
  cols = np.minimum(bk, s - bk * np.arange(nk)).clip(min=0)
  return float(np.einsum("...ij,i,j->", live.astype(np.float64), rows, cols))


def live_map(b, t, s, segment_ids, q_positions, kv_positions, causal, window_size, bq, bk):
  """`[nq, nk]` float: how many examples of the batch compute each bq x bk block,
  by block_map.py's rule on the mask inputs known at trace time (traced ones:
  one document in natural positions), the lengths padded to whole blocks with
  padding (segment 0, position 0) as the blockwise kernel pads them. Evaluated
  with numpy on the host. Unknown positions of a call with fewer queries than
  keys (all_gather's shard against the whole sequence): averaged over the s / t
  shards the queries may be."""
  seg, qp, kp = known_mask(segment_ids, q_positions, kv_positions)
  nq, nk = -(-t // bq), -(-s // bk)

  def rows(x, length, to, default):
    x = np.broadcast_to(default if x is None else np.asarray(x, np.int64), (b, length))
    return np.pad(x, ((0, 0), (0, to - length)))

  q_seg, kv_seg = seg if isinstance(seg, tuple) else (seg, seg)
  if q_seg is None and (nq * bq != t or nk * bk != s):
    q_seg, kv_seg = np.ones((b, t), np.int64), np.ones((b, s), np.int64)
  q_seg = None if q_seg is None else rows(q_seg, t, nq * bq, None).reshape(b, nq, bq)
  kv_seg = None if kv_seg is None else rows(kv_seg, s, nk * bk, None).reshape(b, nk, bk)
  kpos = rows(kp, s, nk * bk, np.arange(s)).reshape(b, nk, bk)
  offsets = range(0, s, t) if qp is None and kp is None and t < s and s % t == 0 else [0]
  total = np.zeros((nq, nk))
  for off in offsets:
    qpos = rows(qp, t, nq * bq, off + np.arange(t)).reshape(b, nq, bq)
    for i in range(b):
      qs = block_stats(qpos[i], None if q_seg is None else q_seg[i], np)
      ks = block_stats(kpos[i], None if kv_seg is None else kv_seg[i], np)
      total += block_map(qs, ks, causal, window_size, np)[0]
  return total / len(offsets)
