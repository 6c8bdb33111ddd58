"""The retrieval tasks as training sources for the data mixture.

`register_retrieval_sources()` registers one lctx.data source per task, named
`retrieval_<task>` (e.g. `DataConfig.sources = ('text', 'retrieval_passkey')`).
Documents are built by `training_example_at`, whose seeds are always below
EVAL_SEED_BASE, so no training document is an eval example. Each document's
length is drawn uniformly between the task's shortest sensible length (MIN_TOKENS,
with the byte tokenizer) and the full row, so the model sees needles at every
distance up to its training length, and short documents pack several to a row:
more answers per step, which is what a small model learns retrieval from.
"""

from __future__ import annotations

import hashlib

import numpy as np

from lctx import data as data_lib
from lctx.evals.tasks import TASKS, training_example_at

PREFIX = "retrieval_"
# Shortest document drawn per task: the needles, question and answer plus some
# filler with the byte tokenizer (a passkey example needs ~105 tokens, a
# niah_single one ~220; the others hold several needles).
MIN_TOKENS = {"passkey": 128, "niah_single": 256}
DEFAULT_MIN_TOKENS = 256


def _length_of(task: str, index: int, seed: int, split: str, max_tokens: int) -> int:
  key = repr(("len", split, int(seed), int(index))).encode()
  u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
  low = min(max_tokens, MIN_TOKENS.get(task, DEFAULT_MIN_TOKENS))
  return low + u % (max_tokens - low + 1) if max_tokens > low else max_tokens


def _source_for(task: str):
  def make_document(
    index: int, *, seed: int, split: str, max_tokens: int, tokenizer
  ) -> tuple[np.ndarray, np.ndarray]:
    length = _length_of(task, index, seed, split, max_tokens)
    # Validation rows come from another seed stream than training rows.
    stream = seed if split == "train" else seed + 7_919
    try:
      ex = training_example_at(
        task, length, index, seed=stream, tokenizer=tokenizer, answer_loss_only=True
      )
    except ValueError:
      # This draw's needles do not fit the sampled length (e.g. a subword
      # tokenizer or long variable names); the full row is the longest we may
      # use (and raises a clear error if even that fails).
      ex = training_example_at(
        task, max_tokens, index, seed=stream, tokenizer=tokenizer, answer_loss_only=True
      )
    # Batch-contract row -> document layout: tokens [L + 1], and
    # target_mask[j] = loss on predicting token j.
    tokens = np.concatenate([ex["inputs"], ex["targets"][-1:]]).astype(np.int32)
    mask = np.concatenate([[0.0], ex["loss_mask"]]).astype(np.float32)
    return tokens, mask

  return make_document


def register_retrieval_sources() -> None:
  """Idempotent: registers `retrieval_<task>` for every task in TASKS."""
  have = set(data_lib.task_source_names())
  for task in TASKS:
    if PREFIX + task not in have:
      data_lib.register_task_source(PREFIX + task, _source_for(task))
