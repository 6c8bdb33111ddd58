"""Greedy decoding through the Scorer, and RULER's generation score.

Decoding is by full forwards with no KV cache: each call feeds every row's
prompt plus its decoded tokens (right-padded to one width per call, so the
sharded program compiles once per grid length) and reads back argmaxes through
the Scorer's `score_index` (lctx/evals/scoring.py). So it runs under the run's
context-parallel strategy.

Plain path (no drafts): one forward of the whole row per decoded token; a budget
of N tokens costs up to N forwards, N times the teacher-forced score.

Draft-verified path (`drafts`, speculative decoding with a known draft): a call
also feeds a guess of the next tokens d_0..d_{k-1} (k < _K) after the row and
reads the argmax at the row's last position and at each draft position. The
argmax after d_0..d_{j-1} is the greedy token g_j whenever d_0..d_{j-1} equal
g_0..g_{j-1} (the model is causal: later tokens cannot change it), so one
forward yields the greedy tokens up to and including the first mismatch (at
least one). The result is token for token the plain path's. Drafts: first the
example's own answer tokens (those the teacher-forced score feeds), then, once
they are used up or contradicted, `lookup` proposes the tokens that followed the
latest earlier occurrence of the row's last few tokens (prompt-lookup decoding:
a model that copies from its context is guessed right). The teacher-forced
score's forward (prompt + answer, its argmax at each answer position) is the
first verifying forward, so it is not run again (`draft_argmax`; its rows may
be padded to a shorter width than the decoding calls', which changes no
argmax in exact arithmetic, only float rounding, as any two padded widths do). Per example,
beyond the teacher-forced forward: 0 forwards when the greedy continuation is
the answer (its text then holds the references), 1 or more after a first
mismatch (about one per stretch the lookup guesses right, one per token at
worst: the plain path's count).

A row stops at EOS, at its budget, or once its decoded text holds every
reference (RULER's string match only looks for the references, and text added
later cannot remove a match, so stopping there gives the same score); a batch
stops when all its rows have.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
from absl import logging

from lctx.evals import ruler
from lctx.evals.scoring import Scorer, as_scorer, round_up

_K = 8  # argmaxes read per row and call (score_index width, as the teacher-forced score's)
_NGRAM = 3  # longest row suffix the lookup draft matches


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
  drafts: Sequence[np.ndarray | None] | None = None,
  lookup: bool = False,
  draft_argmax: Sequence[np.ndarray | None] | None = None,
  stats: dict | None = None,
) -> list[tuple[np.ndarray, str]]:
  """Per prompt (int32 [T_i]) the greedy continuation of up to budgets[i]
  tokens: (ids int32 [n_i], decoded text, EOS excluded). `refs`: stop a row
  once its text holds all of them. `width`: the padded row length of every
  call (default: the batch's longest prompt + budget, rounded up to
  length_multiple). `drafts` (per prompt int [D_i] or None) and `lookup`: the
  draft-verified path (module docstring), the same tokens in fewer forwards.
  `draft_argmax` (per prompt int [m_i] or None, m_i <= D_i): the argmaxes an
  earlier forward of prompt + drafts[i] gave after drafts[i][:j], j < m_i (the
  teacher-forced score's), taken as that forward's result: no call for them.
  `stats`, if given, gets `forwards` (calls to the model) added."""
  scorer: Scorer = as_scorer(model)
  out: list = [None] * len(prompts)
  verify = drafts is not None or lookup
  t0 = time.perf_counter()
  calls = 0
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  for start in range(0, len(order), batch_size):
    idx = order[start : start + batch_size]
    need = max(len(prompts[i]) + budgets[i] for i in idx)
    t = max(round_up(need, max(1, length_multiple)), width or 0)
    rows = [
      _Row(
        tokens=[int(x) for x in prompts[i]],
        budget=budgets[i],
        refs=tuple(refs[i]) if refs else (),
        pending=[] if drafts is None or drafts[i] is None else [int(x) for x in drafts[i]],
      )
      for i in idx
    ]
    for row, i in zip(rows, idx):
      known = None if draft_argmax is None else draft_argmax[i]
      if known is not None and len(known) and not row.done:
        if len(known) > len(row.pending):
          raise ValueError(f"draft_argmax[{i}] is longer than drafts[{i}].")
        row.take(known, row.pending[: len(known) - 1], tokenizer)
    while not all(row.done for row in rows):
      guess: list[list[int]] = [[] for _ in rows]
      if verify:
        for r, row in enumerate(rows):
          room = min(_K - 1, row.budget - len(row.gen) - 1)
          if row.done or room <= 0:
            continue
          if not row.pending and lookup:
            row.pending = _lookup(row.tokens, room)
          guess[r] = row.pending[:room]
      top = np.asarray(scorer(_batch([row.tokens for row in rows], guess, batch_size, t))["argmax"])
      calls += 1
      for r, row in enumerate(rows):
        if not row.done:
          row.take(top[r], guess[r], tokenizer)
    for row, i in zip(rows, idx):
      out[i] = (np.asarray(row.gen, np.int32), tokenizer.decode(row.gen))
    # Decoding is slow (a full forward per call): say how far it got.
    logging.info(
      "greedy decoding: %d of %d prompts at width %d, %d forwards, %.1f s",
      min(start + batch_size, len(order)),
      len(order),
      t,
      calls,
      time.perf_counter() - t0,
    )
  if stats is not None:
    stats["forwards"] = stats.get("forwards", 0) + calls
  return out


@dataclasses.dataclass
class _Row:
  """One prompt's decoding state: its tokens so far (prompt + decoded), the
  decoded ones, the draft tokens not yet checked, and when it stops."""

  tokens: list[int]
  budget: int
  refs: tuple[str, ...]
  pending: list[int]
  gen: list[int] = dataclasses.field(default_factory=list)
  done: bool = dataclasses.field(init=False, default=False)

  def __post_init__(self):
    self.done = self.budget <= 0

  def take(self, top, guess: list[int], tokenizer) -> None:
    """Takes the greedy tokens one forward of tokens + guess gave (top[j]: the
    argmax after guess[:j]): up to and including the first one that differs
    from the guess, or until the row is done."""
    before = len(self.gen)
    for j in range(len(guess) + 1):
      tok = int(top[j])
      self.done = self._accept(tok, tokenizer)
      if self.done or j == len(guess) or tok != guess[j]:
        break
    # The rest of the draft still applies only if it held for all accepted.
    s = len(self.gen) - before
    self.pending = self.pending[s:] if self.pending[:s] == self.gen[before:] else []

  def _accept(self, tok: int, tokenizer) -> bool:
    """Takes greedy token `tok`; True if the row is done: EOS (not kept), the
    budget reached, or every reference in the decoded text."""
    if tok == tokenizer.eos_id:
      return True
    self.gen.append(tok)
    self.tokens.append(tok)
    if len(self.gen) >= self.budget:
      return True
    if self.refs:
      text = tokenizer.decode(self.gen).lower()
      return all(x.lower() in text for x in self.refs)
    return False


def _lookup(row: list[int], k: int) -> list[int]:
  """Prompt-lookup draft: the up to k tokens that followed the latest earlier
  occurrence of the row's last n tokens (n = _NGRAM down to 1); [] if none."""
  arr = np.asarray(row)
  for n in range(min(_NGRAM, len(row) - 1), 0, -1):
    tail = arr[-n:]
    starts = np.nonzero(arr[: len(row) - n] == tail[0])[0]
    for p in starts[::-1]:
      if np.array_equal(arr[p : p + n], tail):
        return [int(x) for x in arr[p + n : p + n + k]]
  return []


def _batch(
  rows: list[list[int]], guess: list[list[int]], batch_size: int, t: int
) -> dict[str, np.ndarray]:
  """Scorer batch: each row plus its draft, right-padded to t; score_index
  column j is the position that predicts the token after draft[:j] (column 0:
  the row's last position); unused columns 0 (ignored); no loss buckets."""
  inputs = np.zeros((batch_size, t), np.int32)
  positions = np.zeros((batch_size, t), np.int32)
  segment_ids = np.zeros((batch_size, t), np.int32)
  index = np.zeros((batch_size, _K), np.int32)
  for r, (row, g) in enumerate(zip(rows, guess)):
    seq = row + g
    n = len(seq)
    inputs[r, :n], positions[r, :n], segment_ids[r, :n] = seq, np.arange(n), 1
    index[r, : len(g) + 1] = np.arange(len(row) - 1, n)
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
  verify: bool = True,
  teacher_forced: Sequence[dict] | None = None,
  stats: dict | None = None,
) -> list[dict]:
  """Per example (tokens, answer_start, answer_items, metric, max_new_tokens):
  `generation_score` (RULER's metric on the greedy continuation of the prompt
  tokens[:answer_start], a fraction in [0, 1]), `generation` (the text), `ids`
  (the decoded token ids, a list) and `tokens` (their count). Each example
  decodes at most min(max_new_tokens, its own budget) tokens. `verify`: the
  draft-verified path with the example's answer tokens tokens[answer_start:]
  as the first draft, then lookup drafts (the same tokens as the plain path, in
  fewer forwards); `teacher_forced`: with verify, score_answers' results for
  the same examples, whose `argmax` is the first verifying forward (no call
  for it); `stats` as in greedy_decode."""
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
    drafts=[np.asarray(ex.tokens[ex.answer_start :]) for ex in examples] if verify else None,
    lookup=verify,
    draft_argmax=[s["argmax"] for s in teacher_forced] if verify and teacher_forced else None,
    stats=stats,
  )
  return [
    {
      "generation_score": ruler.example_score(text, r, getattr(ex, "metric", "all")),
      "generation": text,
      "ids": [int(x) for x in ids],
      "tokens": int(ids.size),
    }
    for ex, r, (ids, text) in zip(examples, refs, decoded)
  ]
