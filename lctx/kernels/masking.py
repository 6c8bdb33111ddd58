"""Mask arguments shared by every attention kernel: validation and normalisation.

The mask semantics (one definition, used by the reference and by every kernel):

- segment ids: a query attends only to keys with the same segment id; id 0 marks
  padding, and a padding query sees nothing (its output is 0).
- causal: a query at position p sees keys at positions <= p. Causality is decided
  on *positions*, never on array order, so zigzag-reordered rows and visiting ring
  blocks get the right mask.
- window_size w: a query at position p sees keys at positions in (p - w, p]
  (w keys including itself). Without causality the window is symmetric:
  |p - p_k| < w.

Shapes: q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, V]`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

# lse of a query row that sees no key. Finite so that ring merges
# (exp(lse_i - max_j lse_j)) never produce NaN; any real lse is far above it.
MASKED_LSE = -1e30


class MaskArgs(NamedTuple):
  """Normalised mask inputs. All int32.

  q_segment_ids `[B, T]`, kv_segment_ids `[B, S]` (None: no segments),
  q_positions `[B, T]`, kv_positions `[B, S]`.
  """

  q_segment_ids: jnp.ndarray | None
  kv_segment_ids: jnp.ndarray | None
  q_positions: jnp.ndarray
  kv_positions: jnp.ndarray


def _as_batched(x, batch: int, length: int, name: str) -> jnp.ndarray:
  x = jnp.asarray(x)
  if x.ndim == 1:
    x = x[None, :]
  if x.ndim != 2 or x.shape[-1] != length or x.shape[0] not in (1, batch):
    raise ValueError(
      f"{name} must be [batch={batch}, len={length}] (or [len]); got shape {x.shape}"
    )
  return jnp.broadcast_to(x.astype(jnp.int32), (batch, length))


def check_shapes(q, k, v) -> tuple[int, int, int, int, int, int, int]:
  """Validates q/k/v shapes; returns (B, T, S, N, K, H, V)."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
      "q, k, v must be rank 4 ([batch, len, heads, head_dim]); got ranks "
      f"{q.ndim}, {k.ndim}, {v.ndim}"
    )
  b, t, n, h = q.shape
  bk, s, kh, hk = k.shape
  bv, sv, kv_heads_v, vd = v.shape
  if bk != b or bv != b:
    raise ValueError(f"batch sizes differ: q {b}, k {bk}, v {bv}")
  if sv != s or kv_heads_v != kh:
    raise ValueError(f"k {k.shape} and v {v.shape} must share [batch, len, heads]")
  if hk != h:
    raise ValueError(f"q head_dim {h} != k head_dim {hk}")
  if kh == 0 or n % kh != 0:
    raise ValueError(f"q_heads ({n}) must be a multiple of kv_heads ({kh}) for GQA/MQA grouping")
  return b, t, s, n, kh, h, vd


def normalize_mask_args(
  batch: int,
  q_len: int,
  kv_len: int,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  window_size=None,
) -> MaskArgs:
  """Turns the public mask arguments into MaskArgs (see module docstring)."""
  if window_size is not None and int(window_size) < 1:
    raise ValueError(f"window_size must be None or >= 1; got {window_size}")
  q_seg = kv_seg = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError("segment_ids pair must be (q_segment_ids, kv_segment_ids)")
      q_seg, kv_seg = segment_ids
    else:
      if q_len != kv_len:
        raise ValueError(
          f"a single segment_ids array needs q_len == kv_len (got {q_len} vs "
          f"{kv_len}); pass a (q_ids, kv_ids) pair instead"
        )
      q_seg = kv_seg = segment_ids
    q_seg = _as_batched(q_seg, batch, q_len, "q segment_ids")
    kv_seg = _as_batched(kv_seg, batch, kv_len, "kv segment_ids")
  if q_positions is None:
    q_positions = jnp.arange(q_len, dtype=jnp.int32)
  if kv_positions is None:
    kv_positions = jnp.arange(kv_len, dtype=jnp.int32)
  q_pos = _as_batched(q_positions, batch, q_len, "q_positions")
  kv_pos = _as_batched(kv_positions, batch, kv_len, "kv_positions")
  return MaskArgs(q_seg, kv_seg, q_pos, kv_pos)


def visible(q_pos, q_seg, kv_pos, kv_seg, causal: bool, window_size):
  """THE mask rule, elementwise with broadcasting: may a query attend to a key?

  A query at position p in segment s sees keys of segment s (s != 0; 0 is
  padding) at positions <= p when causal, and within window_size of p (keys at
  positions > p - w; also < p + w when not causal). Segment ids may be None (one
  segment, no padding). Every kernel and reference applies this function.
  """
  vis = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(kv_pos)), dtype=bool)
  if q_seg is not None:
    vis = vis & (q_seg == kv_seg) & (q_seg != 0)
  if causal:
    vis = vis & (kv_pos <= q_pos)
  if window_size is not None:
    w = int(window_size)
    vis = vis & (kv_pos > q_pos - w)
    if not causal:
      vis = vis & (kv_pos < q_pos + w)
  return vis


def dense_mask(mask: MaskArgs, causal: bool, window_size) -> jnp.ndarray:
  """Boolean visibility `[B, T, S]` (True = query may attend to key)."""
  seg = mask.q_segment_ids is not None
  return visible(
    mask.q_positions[:, :, None],
    mask.q_segment_ids[:, :, None] if seg else None,
    mask.kv_positions[:, None, :],
    mask.kv_segment_ids[:, None, :] if seg else None,
    causal,
    window_size,
  )


def default_scale(head_dim: int, softmax_scale) -> float:
  return float(head_dim) ** -0.5 if softmax_scale is None else float(softmax_scale)


def pad_axis(x, target: int, axis: int, value=0):
  """x padded with `value` at the end of `axis` up to length `target`."""
  pad = target - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)
