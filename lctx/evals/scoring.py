"""Teacher-forced scoring through the training forward pass.

`logits_fn(batch) -> logits` is the trainer's wrapper around the sharded forward
(`Trainer.logits_fn`):
batch holds `inputs, positions, segment_ids` int32 [B, T] in natural order and
it returns float32 logits [B, T, E]. Rows here are RIGHT-padded to a multiple of
`length_multiple` with pad id 0, segment 0 and position 0, so real tokens keep
positions 0..n-1 exactly as in training and, the model being causal, the padding
cannot change their logits. Batches are always padded to `batch_size` rows (all-
pad rows) so the compiled forward sees one shape per length.

Greedy decoding emits the gold answer iff, at every answer position, the argmax
under teacher forcing equals the gold token: decoding step i conditions on
decoded tokens 0..i-1, which equal the gold ones exactly while the argmaxes have
matched. So one forward pass per example gives greedy exact match; ties are
broken like np.argmax (lowest id), as a greedy decoder using argmax would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

LogitsFn = Callable[[dict[str, np.ndarray]], np.ndarray]


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def make_batch(
  rows: Sequence[np.ndarray], *, batch_size: int, length_multiple: int = 1
) -> dict[str, np.ndarray]:
  """Right-pads token rows into `inputs, positions, segment_ids` int32
  [batch_size, T], T = round_up(max row length, length_multiple)."""
  if len(rows) > batch_size:
    raise ValueError(f"{len(rows)} rows do not fit batch_size={batch_size}.")
  t = round_up(max(len(r) for r in rows), max(1, length_multiple))
  inputs = np.zeros((batch_size, t), np.int32)
  positions = np.zeros((batch_size, t), np.int32)
  segment_ids = np.zeros((batch_size, t), np.int32)
  for i, r in enumerate(rows):
    n = len(r)
    inputs[i, :n] = r
    positions[i, :n] = np.arange(n)
    segment_ids[i, :n] = 1
  return {"inputs": inputs, "positions": positions, "segment_ids": segment_ids}


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  m = x.max(axis=-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def token_scores(
  logits_fn: LogitsFn,
  sequences: Sequence[np.ndarray],
  target_masks: Sequence[np.ndarray],
  *,
  batch_size: int,
  length_multiple: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Scores selected next-token targets of each sequence in one forward each.

  sequences[i] is int32 [T_i]; target_masks[i] is bool [T_i] marking positions
  t >= 1 whose token is scored given tokens[:t] (the logits at t - 1). Returns,
  per sequence, (logprob float64 [n_i], argmax_correct bool [n_i]) over the
  marked positions in order. Sequences are grouped by length (stable shapes).
  """
  if len(sequences) != len(target_masks):
    raise ValueError("sequences and target_masks differ in length.")
  out: list = [None] * len(sequences)
  order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
  for start in range(0, len(order), batch_size):
    idx = order[start : start + batch_size]
    batch = make_batch(
      [sequences[i] for i in idx], batch_size=batch_size, length_multiple=length_multiple
    )
    logits = np.asarray(logits_fn(batch))
    if logits.shape[:2] != batch["inputs"].shape:
      raise ValueError(
        f"logits_fn returned {logits.shape}, expected {batch['inputs'].shape + ('E',)}."
      )
    top = max(int(np.max(sequences[i])) for i in idx)
    if top >= logits.shape[-1]:
      raise ValueError(
        f"logits have E={logits.shape[-1]} entries but a token id "
        f"is {top}: the model's vocab_size must be at least the "
        "tokenizer's vocab_size."
      )
    for row, i in enumerate(idx):
      seq, mask = np.asarray(sequences[i]), np.asarray(target_masks[i], bool)
      if mask.shape != seq.shape or (mask.size and mask[0]):
        raise ValueError("target mask must match the sequence and exclude t=0.")
      t = np.nonzero(mask)[0]
      rows = logits[row, t - 1]  # [n, E]: predictions of tokens at t
      gold = seq[t]
      logp = _log_softmax(rows)[np.arange(t.size), gold]
      out[i] = (logp, rows.argmax(axis=-1) == gold)
  return out


def score_answers(
  logits_fn: LogitsFn, examples: Sequence, *, batch_size: int, length_multiple: int = 1
) -> list[dict[str, float]]:
  """Per example (anything with `tokens` [T] and `answer_start`):
  `exact` (1.0 iff greedy decoding would emit the whole answer), `loglik`
  (sum of answer-token log-probs, nats) and `token_acc` (teacher-forced)."""
  masks = []
  for ex in examples:
    m = np.zeros(len(ex.tokens), bool)
    m[ex.answer_start :] = True
    masks.append(m)
  scores = token_scores(
    logits_fn,
    [ex.tokens for ex in examples],
    masks,
    batch_size=batch_size,
    length_multiple=length_multiple,
  )
  return [
    {"exact": float(c.all()), "loglik": float(lp.sum()), "token_acc": float(c.mean())}
    for lp, c in scores
  ]
