"""Zigzag ("dual chunk swap") causal load balancing for ring / usp.

The sequence is cut into 2P equal chunks; device r of the P context devices holds
chunks r and 2P-1-r, so every device owns one early and one late chunk and does the
same causal work (`zigzag_order`, defined in lctx/kernels/token_order.py, where the
kernels read it too). The reorder runs once per batch on the host (data pipeline) for
inputs, targets, positions, segment ids and loss mask; attention decides causality
from the carried true positions, so nothing else needs to know about it.

Works on numpy arrays (host batches) and on jax arrays (inside or outside jit).
`zigzag_permute_local` does the same on a sequence-sharded array inside
shard_map with collective permutes (no device holds more than its shard).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lctx.kernels.token_order import zigzag_order


def _xp(x):
  return np if isinstance(x, np.ndarray) else jnp


def _check(length: int, ring_size: int) -> None:
  if ring_size < 1:
    raise ValueError(f"zigzag: ring_size must be >= 1; got {ring_size}")
  if length % (2 * ring_size) != 0:
    raise ValueError(
      f"zigzag: sequence length {length} is not divisible by 2 x ring_size = {2 * ring_size}"
    )


def _permute_chunks(x, ring_size: int, axis: int, order: np.ndarray):
  xp = _xp(x)
  axis = axis % x.ndim
  length = x.shape[axis]
  _check(length, ring_size)
  n = 2 * ring_size
  shape = x.shape[:axis] + (n, length // n) + x.shape[axis + 1 :]
  chunks = xp.reshape(x, shape)
  chunks = xp.take(chunks, xp.asarray(order), axis=axis)
  return xp.reshape(chunks, x.shape)


def zigzag_reorder(x, ring_size: int, axis: int = 1):
  """Natural token order -> zigzag order along `axis` (numpy in, numpy out)."""
  return _permute_chunks(x, ring_size, axis, zigzag_order(ring_size))


def zigzag_inverse(x, ring_size: int, axis: int = 1):
  """Zigzag order -> natural token order along `axis`; inverse of zigzag_reorder."""
  return _permute_chunks(x, ring_size, axis, np.argsort(zigzag_order(ring_size)))


# ----------------------------------------------------------------------------
# The same reorder on a sequence-sharded global array, by collective permutes
# ----------------------------------------------------------------------------
def zigzag_piece_order(ring_size: int, ways: int) -> np.ndarray:
  """Natural piece held at each zigzag position, for a sequence cut into 2 x ways
  equal pieces (the halves of `ways` equal shards): position m (device m // 2,
  half m % 2) holds natural piece order[m]. Each zigzag chunk is ways / ring_size
  whole pieces."""
  if ways % ring_size:
    raise ValueError(f"zigzag: {ways} sequence shards do not split over ring size {ring_size}")
  per_chunk = ways // ring_size  # pieces per chunk: 2 ring_size chunks of 2 ways pieces
  chunks = zigzag_order(ring_size)
  return np.array([c * per_chunk + i for c in chunks for i in range(per_chunk)])


def zigzag_half_moves(ring_size: int, ways: int, inverse: bool = False):
  """Where each half of each device's sequence shard goes.

  The sequence is sharded in `ways` = ring_size x ulysses equal shards (device d
  holds shard d); each shard is two halves, 2 x ways pieces in all. The zigzag
  order over `ring_size` is a permutation of those pieces (its chunks are whole
  pieces: 2 ring_size chunks of ways / ring_size pieces each). Returns
  `{(src_half, dst_half): [(src_device, dst_device), ...]}`: every group is a
  partial permutation of devices, so each is one ppermute. inverse=True maps
  zigzag order back to the natural order.
  """
  order = zigzag_piece_order(ring_size, ways)
  src_of_dst = np.argsort(order) if inverse else order  # position -> piece it takes
  moves: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for dst_pos, src_pos in enumerate(src_of_dst):
    src_pos, dst_pos = int(src_pos), int(dst_pos)
    key = (src_pos % 2, dst_pos % 2)
    moves.setdefault(key, []).append((src_pos // 2, dst_pos // 2))
  return moves


def zigzag_permute_local(x, *, ring_size: int, axis_names, ways: int, inverse: bool = False):
  """Inside shard_map: the local `[B, L, ...]` shard of a sequence sharded over
  `axis_names` (`ways` shards), natural -> zigzag order (inverse: back). Each
  device sends its two halves with at most four ppermutes of L/2 tokens; nothing
  gathers the sequence, so memory stays O(L)."""
  length = x.shape[1]
  if length % 2:
    raise ValueError(f"zigzag: the local shard length {length} must be even")
  halves = (x[:, : length // 2], x[:, length // 2 :])
  out = [None, None]
  for (src_half, dst_half), perm in sorted(zigzag_half_moves(ring_size, ways, inverse).items()):
    # Devices not named as a destination receive zeros, so the sum is exact.
    got = jax.lax.ppermute(halves[src_half], axis_names, perm)
    out[dst_half] = got if out[dst_half] is None else out[dst_half] + got
  return jnp.concatenate(out, axis=1)
