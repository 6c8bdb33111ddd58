"""Mixing sources by tokens, and one global order cut into per-process rows.

TokenMixIterDataset draws the next window from the source whose realised
tokens are furthest below its weight: the source i with the smallest
tokens_i / weight_i (ties: the lower index). That keeps every source's share
of tokens within one window of its weight at every point of the stream, is a
pure function of the parents' streams (no rng), and its state is the parents'
states plus one token count per source.

rows_of_process: every process builds the same global batch stream from the
same seeded order and keeps its own block of rows, so the global batch at step
k does not depend on the process count, and neither does the iterator state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np


class _TokenMixIterator(grain.DatasetIterator):
  def __init__(self, parents: Sequence[grain.DatasetIterator], weights: Sequence[float]):
    super().__init__(list(parents))
    self._weights = np.asarray(weights, np.float64)
    self._active = np.flatnonzero(self._weights > 0)
    self._tokens = np.zeros(len(weights), np.int64)

  def __next__(self):
    deficit = self._tokens[self._active] / self._weights[self._active]
    i = int(self._active[int(np.argmin(deficit))])
    element = next(self._parents[i])  # the first source to end ends the mix
    self._tokens[i] += len(element["inputs"])
    return element

  def get_state(self) -> dict[str, Any]:
    return {
      "parents": [p.get_state() for p in self._parents],
      "tokens": [int(t) for t in self._tokens],
    }

  def set_state(self, state: dict[str, Any]) -> None:
    for parent, parent_state in zip(self._parents, state["parents"]):
      parent.set_state(parent_state)
    self._tokens = np.asarray(state["tokens"], np.int64)


class TokenMixIterDataset(grain.IterDataset):
  """Windows of several sources (dicts with 'inputs' [n]), mixed so that each
  source's share of tokens follows `weights` (normalised; 0 = never read)."""

  def __init__(self, parents: Sequence[grain.IterDataset], weights: Sequence[float]):
    super().__init__(list(parents))
    if len(weights) != len(parents) or min(weights) < 0 or sum(weights) <= 0:
      raise ValueError(f"mix weights {tuple(weights)} must be >= 0 with a positive sum.")
    self._weights = tuple(float(w) / sum(weights) for w in weights)

  def __iter__(self) -> grain.DatasetIterator:
    return _TokenMixIterator([iter(p) for p in self._parents], self._weights)

  def __str__(self) -> str:
    return f"TokenMixIterDataset(weights={self._weights})"


def rows_of_process(
  batch: dict[str, np.ndarray], process_index: int, rows_per_process: int
) -> dict[str, np.ndarray]:
  """Process i's block of a global batch: rows [i * n, (i + 1) * n)."""
  lo = process_index * rows_per_process
  return {k: v[lo : lo + rows_per_process] for k, v in batch.items()}
