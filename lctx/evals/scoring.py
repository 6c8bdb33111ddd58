"""Teacher-forced scoring: only the scored positions leave the model.

The evals see the model as a `Scorer` (the trainer's `Trainer.score_fn`: the
sharded forward plus the chunked loss, lctx/trainer.py). A batch in natural
order holds

    inputs, positions, segment_ids, targets   int32 [B, T]
    score_index                               int32 [B, K]
    bucket                                    int32 [B, T]

where targets[:, p] = inputs[:, p + 1] (the token position p predicts; 0 past
the end), score_index lists the positions p whose prediction is returned one by
one (the answer tokens; padding 0, ignored) and bucket[:, p] in [0,
NUM_BUCKETS) adds position p's loss to that bucket's sum (-1: none). It returns
numpy

    logp         float [B, K]   log p(targets[p]) at score_index
    correct      bool  [B, K]   argmax == targets[p] there
    bucket_loss  float [B, NUM_BUCKETS]   sum of -logp per bucket

so what crosses to the host is O(answer tokens), never [B, T, E] logits. A plain
callable `logits_fn(batch) -> float32 [B, T, E]` (toy oracles, the host-logits
reference path) is wrapped by `logits_scorer`, which computes the same from full
logits on the host.

Rows are RIGHT-padded to a multiple of `length_multiple` with pad id 0, segment
0 and position 0, so real tokens keep positions 0..n-1 exactly as in training
and, the model being causal, the padding cannot change their scores. Batches are
always padded to `batch_size` rows (all-pad rows) so the compiled step sees one
shape per length.

Greedy decoding emits the gold answer iff, at every answer position, the argmax
under teacher forcing equals the gold token: decoding step i conditions on
decoded tokens 0..i-1, which equal the gold ones exactly while the argmaxes have
matched. So one forward pass per example gives greedy exact match; ties are
broken like np.argmax (lowest id), as a greedy decoder using argmax would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

LogitsFn = Callable[[dict[str, np.ndarray]], np.ndarray]
NUM_BUCKETS = 32
"""Loss buckets per row a Scorer sums (log2 position buckets reach 2**32 tokens)."""
_MIN_WIDTH = 8  # K is a power of two >= this: few compiled shapes


@dataclasses.dataclass(frozen=True)
class Scorer:
  """A scoring function of the contract in the module docstring."""

  fn: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]

  def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return self.fn(batch)


def as_scorer(model: Scorer | LogitsFn) -> Scorer:
  """A Scorer as is; a logits_fn wrapped by `logits_scorer`."""
  return model if isinstance(model, Scorer) else logits_scorer(model)


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


def logits_scorer(logits_fn: LogitsFn) -> Scorer:
  """The Scorer contract computed on the host from full float32 logits
  `[B, T, E]` (float64 log-softmax): toy oracles and the reference that the
  in-program scores are tested against."""

  def fn(batch):
    x = {k: batch[k] for k in ("inputs", "positions", "segment_ids")}
    logits = np.asarray(logits_fn(x))
    if logits.shape[:2] != batch["inputs"].shape:
      raise ValueError(
        f"logits_fn returned {logits.shape}, expected {batch['inputs'].shape + ('E',)}."
      )
    check_vocab(batch["inputs"], logits.shape[-1])
    b, k = batch["score_index"].shape
    logp, correct = np.zeros((b, k)), np.zeros((b, k), bool)
    top = np.zeros((b, k), np.int32)
    bucket_loss = np.zeros((b, NUM_BUCKETS))
    for r in range(b):
      idx = batch["score_index"][r]
      binned = np.nonzero(batch["bucket"][r] >= 0)[0]
      pos = np.union1d(idx, binned)
      rows = logits[r, pos]  # [n, E]: the predictions made at pos
      gold = batch["targets"][r, pos]
      lp = _log_softmax(rows)[np.arange(pos.size), gold]
      at = np.searchsorted(pos, idx)
      logp[r], correct[r] = lp[at], (rows.argmax(axis=-1) == gold)[at]
      top[r] = rows.argmax(axis=-1)[at]
      sel = np.searchsorted(pos, binned)
      np.add.at(bucket_loss[r], batch["bucket"][r, binned], -lp[sel])
    return {"logp": logp, "correct": correct, "argmax": top, "bucket_loss": bucket_loss}

  return Scorer(fn)


def check_vocab(inputs: np.ndarray, vocab_size: int) -> None:
  top = int(np.max(inputs))
  if top >= vocab_size:
    raise ValueError(
      f"the model scores {vocab_size} token ids but a token id is {top}: the model's "
      "vocab_size must be at least the tokenizer's vocab_size."
    )


def _width(n: int) -> int:
  return max(_MIN_WIDTH, 1 << max(0, n - 1).bit_length())


def make_score_batch(
  rows: Sequence[np.ndarray],
  target_masks: Sequence[np.ndarray],
  *,
  batch_size: int,
  length_multiple: int = 1,
  buckets: Sequence[np.ndarray | None] | None = None,
) -> dict[str, np.ndarray]:
  """make_batch plus `targets`, `score_index` (from target_masks: bool [T_i],
  True at the scored target positions t >= 1, so index t - 1) and `bucket`
  (buckets[i]: int [T_i] bucket of target t, -1 none; stored at t - 1)."""
  batch = make_batch(rows, batch_size=batch_size, length_multiple=length_multiple)
  b, t = batch["inputs"].shape
  targets = np.zeros((b, t), np.int32)
  targets[:, :-1] = batch["inputs"][:, 1:]
  scored = [np.nonzero(np.asarray(m, bool))[0] for m in target_masks]
  index = np.zeros((b, _width(max(len(s) for s in scored))), np.int32)
  bucket = np.full((b, t), -1, np.int32)
  for i, s in enumerate(scored):
    index[i, : s.size] = s - 1
    if buckets is not None and buckets[i] is not None:
      bk = np.asarray(buckets[i])
      bucket[i, : bk.size - 1] = bk[1:]
  return {**batch, "targets": targets, "score_index": index, "bucket": bucket}


def score_rows(
  model: Scorer | LogitsFn,
  sequences: Sequence[np.ndarray],
  target_masks: Sequence[np.ndarray],
  *,
  batch_size: int,
  length_multiple: int = 1,
  buckets: Sequence[np.ndarray] | None = None,
  with_argmax: bool = False,
) -> list[tuple[np.ndarray, ...]]:
  """token_scores plus, with `buckets` (per sequence int [T_i]: the bucket of
  target t in [0, NUM_BUCKETS), -1 none), each sequence's loss sum per bucket
  float [NUM_BUCKETS]; without, zeros. `with_argmax`: a 4th element, the
  argmax int64 [n_i] at the marked positions (the greedy next tokens)."""
  if len(sequences) != len(target_masks):
    raise ValueError("sequences and target_masks differ in length.")
  scorer = as_scorer(model)
  out: list = [None] * len(sequences)
  order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
  for start in range(0, len(order), batch_size):
    idx = order[start : start + batch_size]
    for i in idx:
      seq, mask = np.asarray(sequences[i]), np.asarray(target_masks[i], bool)
      if mask.shape != seq.shape or (mask.size and mask[0]):
        raise ValueError("target mask must match the sequence and exclude t=0.")
    batch = make_score_batch(
      [sequences[i] for i in idx],
      [target_masks[i] for i in idx],
      batch_size=batch_size,
      length_multiple=length_multiple,
      buckets=None if buckets is None else [buckets[i] for i in idx],
    )
    res = scorer(batch)
    for row, i in enumerate(idx):
      n = int(np.count_nonzero(target_masks[i]))
      out[i] = (
        np.asarray(res["logp"][row, :n], np.float64),
        np.asarray(res["correct"][row, :n], bool),
        np.asarray(res["bucket_loss"][row], np.float64),
        *([np.asarray(res["argmax"][row, :n], np.int64)] if with_argmax else []),
      )
  return out


def token_scores(
  model: Scorer | LogitsFn,
  sequences: Sequence[np.ndarray],
  target_masks: Sequence[np.ndarray],
  *,
  batch_size: int,
  length_multiple: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Scores selected next-token targets of each sequence in one forward each.

  sequences[i] is int32 [T_i]; target_masks[i] is bool [T_i] marking positions
  t >= 1 whose token is scored given tokens[:t]. Returns, per sequence,
  (logprob float64 [n_i], argmax_correct bool [n_i]) over the marked positions
  in order. Sequences are grouped by length (stable shapes).
  """
  rows = score_rows(
    model, sequences, target_masks, batch_size=batch_size, length_multiple=length_multiple
  )
  return [(lp, c) for lp, c, _ in rows]


def score_answers(
  model: Scorer | LogitsFn, examples: Sequence, *, batch_size: int, length_multiple: int = 1
) -> list[dict]:
  """Per example (anything with `tokens` [T] and `answer_start`):
  `exact` (1.0 iff greedy decoding would emit the whole answer), `loglik`
  (sum of answer-token log-probs, nats), `token_acc` (teacher-forced) and
  `argmax` (int64 [n]: the argmax at each answer position, the prediction after
  the answer's first j tokens; greedy decoding reuses it, lctx/evals/generate.py)."""
  masks = []
  for ex in examples:
    m = np.zeros(len(ex.tokens), bool)
    m[ex.answer_start :] = True
    masks.append(m)
  scores = score_rows(
    model,
    [ex.tokens for ex in examples],
    masks,
    batch_size=batch_size,
    length_multiple=length_multiple,
    with_argmax=True,
  )
  return [
    {
      "exact": float(c.all()),
      "loglik": float(lp.sum()),
      "token_acc": float(c.mean()),
      "argmax": top,
    }
    for lp, c, _, top in scores
  ]
