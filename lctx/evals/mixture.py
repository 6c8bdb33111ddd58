"""The retrieval tasks as training sources for the data mixture.

`register_retrieval_sources()` registers one lctx.data source per task, named
`retrieval_<task>` (e.g. `DataConfig.sources = ('text', 'retrieval_passkey')`).
Documents are built by `training_example_at`, whose seeds are always below
EVAL_SEED_BASE, so no training document is an eval example. Each document's
length is drawn between max(256, a quarter of the row) and the full row, so the model
sees needles at every distance up to its training length.
"""
from __future__ import annotations

import hashlib

import numpy as np

from lctx import data as data_lib
from lctx.evals.tasks import TASKS, training_example_at

PREFIX = "retrieval_"


def _length_of(index: int, seed: int, split: str, max_tokens: int) -> int:
  key = repr(("len", split, int(seed), int(index))).encode()
  u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
  # Long enough for every task's needles (variable tracking needs the most).
  low = min(max_tokens, max(256, max_tokens // 4))
  return low + u % (max_tokens - low + 1) if max_tokens > low else max_tokens


def _source_for(task: str):
  def make_document(index: int, *, seed: int, split: str, max_tokens: int,
                    tokenizer) -> tuple[np.ndarray, np.ndarray]:
    length = _length_of(index, seed, split, max_tokens)
    # Validation rows come from another seed stream than training rows.
    stream = seed if split == "train" else seed + 7_919
    try:
      ex = training_example_at(task, length, index, seed=stream,
                               tokenizer=tokenizer, answer_loss_only=True)
    except ValueError:
      # This draw's needles do not fit the sampled length; the full row is
      # the longest we may use (and raises a clear error if even that fails).
      ex = training_example_at(task, max_tokens, index, seed=stream,
                               tokenizer=tokenizer, answer_loss_only=True)
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
