"""The token orders a sequence is held in: natural, or zigzag over a ring.

The zigzag ("dual chunk swap") order over ring size P cuts the sequence into 2P
equal chunks; array slots 2r, 2r+1 hold natural chunks r and 2P-1-r, so device r
of a P-device ring owns one early and one late chunk and does the same causal
work. `zigzag_order` is that rule, the one definition of it: lctx.parallel.zigzag
reorders batches by it, and the kernels that mask on the natural token index
(splash) read a call's rows back through `TokenOrder` / `Layout`.

- `TokenOrder(length, zigzag)` (static): natural (zigzag=0) or zigzag with ring
  size Z; `natural(p)` maps an array index of that global sequence to its
  natural token index.
- `Layout(order, q_start, kv_start)`: a call's q rows are the global array
  indices q_start + [0, T) and its kv rows kv_start + [0, S); the starts may be
  traced (a device's shard index, a ring step).
- The promise a Layout makes: positions count up by one along the natural index
  inside every segment, and each segment is contiguous in natural order (what
  the data pipeline produces: packed rows, 'absolute' or 'restart' positions).
  Then causality and windows on positions are causality and windows on the
  natural index (segment ids do the rest). `layout=None` means the array order
  is the natural order for both q and kv.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


def zigzag_order(ring_size: int) -> np.ndarray:
  """Chunk order [0, 2P-1, 1, 2P-2, ...]: slot 2r, 2r+1 hold chunks r, 2P-1-r."""
  p = int(ring_size)
  return np.array([c for r in range(p) for c in (r, 2 * p - 1 - r)], dtype=np.int32)


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
    """Natural chunk held by each array slot (zigzag: `zigzag_order`; natural: [0])."""
    return zigzag_order(self.zigzag) if self.zigzag else np.zeros(1, np.int32)

  def natural(self, p, xp=jnp):
    """Natural token index of global array index p (int32, traced or not; xp=np
    for host arrays)."""
    if not self.zigzag:
      return p
    # `zigzag_order` in closed form (slot 2r holds chunk r, slot 2r+1 chunk
    # 2Z-1-r): elementwise, where a lookup in its table would be a gather.
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
