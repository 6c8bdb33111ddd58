"""Zigzag ("dual chunk swap") causal load balancing for ring / usp.

The sequence is cut into 2P equal chunks; device r of the P context devices holds
chunks r and 2P-1-r, so every device owns one early and one late chunk and does the
same causal work. The reorder runs once per batch on the host (data pipeline) for
inputs, targets, positions, segment ids and loss mask; attention decides causality
from the carried true positions, so nothing else needs to know about it.

Works on numpy arrays (host batches) and on jax arrays (inside or outside jit).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _xp(x):
  return np if isinstance(x, np.ndarray) else jnp


def zigzag_order(ring_size: int) -> np.ndarray:
  """Chunk order [0, 2P-1, 1, 2P-2, ...]: slot 2r, 2r+1 hold chunks r, 2P-1-r."""
  p = int(ring_size)
  return np.array([c for r in range(p) for c in (r, 2 * p - 1 - r)], dtype=np.int32)


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
