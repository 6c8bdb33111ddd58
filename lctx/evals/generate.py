"""Greedy decoding through the Scorer, and RULER's generation score.

Decoding is by repeated full forwards: step i feeds every row's prompt plus its
i decoded tokens (right-padded to one width per call, so the sharded program
compiles once per grid length) and reads back the argmax at each row's last
position (the Scorer's `argmax`, lctx/evals/scoring.py). So it runs under the
run's context-parallel strategy with no KV cache; the cost is one forward of the
whole row per decoded token: a budget of N tokens costs up to N times the
teacher-forced score.

A row stops at EOS, at its budget, or once its decoded text holds every
reference (RULER's string match only looks for the references, and text added
later cannot remove a match, so stopping there gives the same score); a batch
stops when all its rows have.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from absl import logging

from lctx.evals import ruler
from lctx.evals.scoring import Scorer, as_scorer, round_up


def greedy_decode(
  model,
  prompts: Sequence[np.ndarray],
  budgets: Sequence[int],
  tokenizer,
  *,
  refs: Sequence[Sequence[str]] | None = None,
  batch_size: int,
  length_multiple: int = 1,
  width: int | None = None,
) -> list[tuple[np.ndarray, str]]:
  """Per prompt (int32 [T_i]) the greedy continuation of up to budgets[i]
  tokens: (ids int32 [n_i], decoded text, EOS excluded). `refs`: stop a row
  once its text holds all of them. `width`: the padded row length of every
  call (default: the batch's longest prompt + budget, rounded up to
  length_multiple)."""
  scorer: Scorer = as_scorer(model)
  out: list = [None] * len(prompts)
  t0 = time.perf_counter()
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  for start in range(0, len(order), batch_size):
    idx = order[start : start + batch_size]
    need = max(len(prompts[i]) + budgets[i] for i in idx)
    t = max(round_up(need, max(1, length_multiple)), width or 0)
    rows = [list(np.asarray(prompts[i], np.int64)) for i in idx]
    gen: list[list[int]] = [[] for _ in idx]
    done = [budgets[i] <= 0 for i in idx]
    while not all(done):
      batch = _batch(rows, batch_size, t)
      top = np.asarray(scorer(batch)["argmax"])[:, 0]
      for r, i in enumerate(idx):
        if done[r]:
          continue
        tok = int(top[r])
        if tok == tokenizer.eos_id:
          done[r] = True
          continue
        gen[r].append(tok)
        rows[r].append(tok)
        if len(gen[r]) >= budgets[i]:
          done[r] = True
        elif refs is not None:
          text = tokenizer.decode(gen[r]).lower()
          done[r] = all(x.lower() in text for x in refs[i])
    for r, i in enumerate(idx):
      out[i] = (np.asarray(gen[r], np.int32), tokenizer.decode(gen[r]))
    # Decoding is slow (a full forward per token): say how far it got.
    logging.info(
      "greedy decoding: %d of %d prompts at width %d, %.1f s",
      min(start + batch_size, len(order)),
      len(order),
      t,
      time.perf_counter() - t0,
    )
  return out


def _batch(rows: list[list[int]], batch_size: int, t: int) -> dict[str, np.ndarray]:
  """Scorer batch: rows right-padded to t; score_index column 0 is each row's
  last position (what it predicts next); no loss buckets."""
  inputs = np.zeros((batch_size, t), np.int32)
  positions = np.zeros((batch_size, t), np.int32)
  segment_ids = np.zeros((batch_size, t), np.int32)
  index = np.zeros((batch_size, 8), np.int32)
  for r, row in enumerate(rows):
    n = len(row)
    inputs[r, :n], positions[r, :n], segment_ids[r, :n] = row, np.arange(n), 1
    index[r, 0] = n - 1
  targets = np.zeros_like(inputs)
  targets[:, :-1] = inputs[:, 1:]
  bucket = np.full((batch_size, t), -1, np.int32)
  return {
    "inputs": inputs,
    "positions": positions,
    "segment_ids": segment_ids,
    "targets": targets,
    "score_index": index,
    "bucket": bucket,
  }


def generation_scores(
  model,
  examples: Sequence,
  tokenizer,
  *,
  max_new_tokens: int,
  batch_size: int,
  length_multiple: int = 1,
  width: int | None = None,
) -> list[dict]:
  """Per example (tokens, answer_start, answer_items, metric, max_new_tokens):
  `generation_score` (RULER's metric on the greedy continuation of the prompt
  tokens[:answer_start], a fraction in [0, 1]) and `generation` (the text).
  Each example decodes at most min(max_new_tokens, its own budget) tokens."""
  prompts = [np.asarray(ex.tokens[: ex.answer_start]) for ex in examples]
  budgets = [
    min(max_new_tokens, int(getattr(ex, "max_new_tokens", max_new_tokens))) for ex in examples
  ]
  refs = [tuple(ex.answer_items) for ex in examples]
  decoded = greedy_decode(
    model,
    prompts,
    budgets,
    tokenizer,
    refs=refs,
    batch_size=batch_size,
    length_multiple=length_multiple,
    width=width,
  )
  return [
    {
      "generation_score": ruler.example_score(text, r, getattr(ex, "metric", "all")),
      "generation": text,
      "tokens": int(ids.size),
    }
    for ex, r, (ids, text) in zip(examples, refs, decoded)
  ]
