"""Document -> training windows -> packed rows in the batch contract.

A tokenized document is `tokens` int32 [L] (BOS ... EOS) plus `target_mask`
float32 [L] (whether token j counts in the loss when it is a target). It gives
L - 1 next-token examples: inputs = tokens[:-1], targets = tokens[1:].

Documents longer than a row are cut into consecutive windows of seq_len
examples. No target is lost at a cut: window k covers examples
[k*S, (k+1)*S), so its first input is the previous window's last target.
Window `positions` are absolute (k*S + i, the document's true positions) or
restart at 0 ('restart'), chosen by `continuation_positions`.

Packing (grain) then places windows into rows of seq_len; `to_batch_contract`
turns a packed row into the contract of docs/contracts.md:
inputs, targets, segment_ids (0 = pad, 1.. per document in the row),
positions, loss_mask, all [seq].
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

PACKED_FEATURES = ("inputs", "targets", "positions", "loss_mask")
SOURCE_FEATURES = ("source", "doc_len", "doc_start")  # carried only for reports (WindowDocument)


class WindowDocument(grain.experimental.FlatMapTransform):
  """{'tokens' [L], 'target_mask' [L]} -> windows of at most seq_len examples.

  Each window: inputs/targets/positions int32 [n], loss_mask float32 [n], n <= S.
  """

  def __init__(
    self,
    seq_len: int,
    continuation_positions: str,
    max_windows: int | None = None,
    source_id: int | None = None,
  ):
    """max_windows: keep only a document's first that many windows (None: all).
    source_id: when given, each window also carries `source` (this id, >= 1),
    `doc_len` (the whole document's tokens) and `doc_start` (1 on a document's
    first token), int32 [n], for reports."""
    if continuation_positions not in ("absolute", "restart"):
      raise ValueError(
        f"continuation_positions must be 'absolute' or 'restart', got {continuation_positions!r}."
      )
    self.seq_len = seq_len
    self.absolute = continuation_positions == "absolute"
    self.max_windows = max_windows
    self.source_id = source_id
    # Only a bound for grain's bookkeeping; documents longer than this many
    # windows are still cut completely (grain does not enforce it here).
    self.max_fan_out = 1 << 20

  def flat_map(self, element: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    tokens, target_mask = element["tokens"], element["target_mask"]
    n = len(tokens) - 1  # number of next-token examples
    windows = []
    starts = range(0, n, self.seq_len)
    for start in starts[: self.max_windows] if self.max_windows else starts:
      end = min(start + self.seq_len, n)
      first = start if self.absolute else 0
      window = {
        "inputs": tokens[start:end],
        "targets": tokens[start + 1 : end + 1],
        "positions": np.arange(first, first + end - start, dtype=np.int32),
        "loss_mask": target_mask[start + 1 : end + 1],
      }
      if self.source_id is not None:
        window["source"] = np.full(end - start, self.source_id, np.int32)
        window["doc_len"] = np.full(end - start, len(tokens), np.int32)
        window["doc_start"] = (np.arange(start, end) == 0).astype(np.int32)
      windows.append(window)
    return windows


def restart_positions(segment_ids: np.ndarray) -> np.ndarray:
  """Positions counted from each segment's first cell. [..., S] -> [..., S]; pad = 0."""
  seq = segment_ids.shape[-1]
  idx = np.broadcast_to(np.arange(seq, dtype=np.int32), segment_ids.shape)
  prev = np.concatenate(
    [np.full(segment_ids.shape[:-1] + (1,), -1, segment_ids.dtype), segment_ids[..., :-1]], axis=-1
  )
  starts = np.where(segment_ids != prev, idx, 0)
  positions = idx - np.maximum.accumulate(starts, axis=-1)
  return np.where(segment_ids > 0, positions, 0).astype(np.int32)


def to_batch_contract(row: dict[str, Any], *, absolute: bool) -> dict[str, np.ndarray]:
  """A grain-packed row -> the batch contract (all [S]).

  absolute: take `positions` carried from the windows: the document's true
  positions, also for a window that concat_split cut across two rows.
  Otherwise positions restart at every segment start in the row.
  """
  segment_ids = row["inputs_segment_ids"].astype(np.int32)
  if absolute:
    positions = row["positions"].astype(np.int32)
  else:
    positions = restart_positions(segment_ids)
  real = segment_ids > 0
  out = {
    "inputs": np.where(real, row["inputs"], 0).astype(np.int32),
    "targets": np.where(real, row["targets"], 0).astype(np.int32),
    "segment_ids": segment_ids,
    "positions": np.where(real, positions, 0).astype(np.int32),
    "loss_mask": np.where(real, row["loss_mask"], 0).astype(np.float32),
  }
  if "source" in row:  # reports only (WindowDocument source_id): 0 = pad
    out["source_ids"] = np.where(real, row["source"], 0).astype(np.int32)
    out["document_lengths"] = np.where(real, row["doc_len"], 0).astype(np.int32)
    out["document_starts"] = np.where(real, row["doc_start"], 0).astype(np.int32)
  return out
