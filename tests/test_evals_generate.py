"""Draft-verified greedy decoding (lctx/evals/generate.py) gives the plain
path's tokens, token for token, in fewer forwards."""

import numpy as np
import pytest

from lctx.data.tokenizers import ByteTokenizer
from lctx.evals.generate import greedy_decode
from lctx.evals.scoring import Scorer, logits_scorer

TOK = ByteTokenizer()
E = TOK.vocab_size
LETTERS = [TOK.encode(c)[0] for c in "abcdefgh"]


_P = 10_007
_TABLE = np.random.default_rng(0).choice(LETTERS + [TOK.eos_id], size=_P, p=[0.12] * 8 + [0.04])
_NOISE = np.random.default_rng(1).random((_P, E)).astype(np.float32)


def hash_fn(batch):
  """A causal toy LM: position t's argmax is a fixed pseudo-random function of
  tokens t-1 and t (a letter, or EOS for some pairs); other logits are small
  noise from the same pair, so argmaxes are unique."""
  x = batch["inputs"].astype(np.int64)
  prev = np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  key = (prev * 1_000_003 + x * 7919) % _P
  out = _NOISE[key]
  np.put_along_axis(out, _TABLE[key][..., None], 5.0, axis=-1)
  return out


def reference(prompt, budget):
  """Unpadded greedy decoding, one forward per token, EOS excluded."""
  seq, gen = list(prompt), []
  while len(gen) < budget:
    x = np.asarray(seq, np.int32)[None]
    b = {"inputs": x, "positions": np.arange(x.shape[1])[None], "segment_ids": np.ones_like(x)}
    tok = int(np.argmax(hash_fn(b)[0, -1]))
    if tok == TOK.eos_id:
      break
    seq.append(tok)
    gen.append(tok)
  return gen


def counting():
  base = logits_scorer(hash_fn)
  calls = []

  def fn(batch):
    calls.append(batch["inputs"].shape)
    return base(batch)

  return Scorer(fn), calls


def prompts():
  """Prompts whose greedy continuations run 0 to 12 tokens before EOS or the budget."""
  rng = np.random.default_rng(3)
  return [rng.choice(LETTERS, size=int(n)).astype(np.int32) for n in rng.integers(5, 30, 24)]


def decode(ps, budgets, **kw):
  scorer, calls = counting()
  stats = {}
  out = greedy_decode(
    scorer, ps, budgets, TOK, batch_size=kw.pop("batch_size", 3), stats=stats, **kw
  )
  assert stats["forwards"] == len(calls)
  return [list(ids) for ids, _ in out], len(calls)


def test_plain_path_is_unpadded_greedy():
  ps = prompts()
  got, _ = decode(ps, [10] * len(ps), length_multiple=16)
  want = [reference(p, 10) for p in ps]
  assert got == want
  assert len({len(w) for w in want}) > 3  # EOS at several points, some at the budget


@pytest.mark.parametrize("batch_size", [1, 3])
def test_drafts_give_the_plain_tokens(batch_size):
  ps = prompts()
  budgets = [4 + i % 9 for i in range(len(ps))]
  plain, n_plain = decode(ps, budgets, batch_size=batch_size)
  full = [np.asarray(g) for g in plain]  # matches fully
  first = [np.asarray([(g[0] if g else 0) + 1] + g[1:]) for g in plain]  # diverges at once
  mid = [
    np.asarray(g[: len(g) // 2] + [TOK.eos_id if len(g) % 2 else LETTERS[0]] * 5) for g in plain
  ]
  longer = [np.asarray(g + LETTERS * 3) for g in plain]  # right, then past the end
  for drafts in (full, first, mid, longer, [None] * len(ps)):
    for lookup in (False, True):
      got, n = decode(ps, budgets, batch_size=batch_size, drafts=drafts, lookup=lookup)
      assert got == plain
      assert n <= n_plain
  _, n_full = decode(ps, budgets, batch_size=batch_size, drafts=full)
  assert n_full < n_plain


def test_fully_matching_draft_within_budget_costs_one_forward():
  ps = prompts()
  for p in ps:
    g = reference(p, 7)
    stopped_by_eos = len(g) < 7
    budget = len(g) + (1 if stopped_by_eos else 0)
    budget = max(budget, 1)
    [got], n = decode([p], [budget], drafts=[np.asarray(g)], batch_size=1)
    assert got == reference(p, budget) and n == 1
    # no draft: one forward per token (and one for the EOS)
    [got], n = decode([p], [budget], batch_size=1)
    assert n == len(got) + (1 if len(got) < budget else 0)


def test_batch_rows_stop_at_different_forwards():
  ps = prompts()[:3]
  plain, _ = decode(ps, [12, 12, 12], batch_size=3)
  # row 0 fully drafted, row 1 wrong at once, row 2 without a draft
  drafts = [np.asarray(plain[0]), np.asarray([LETTERS[0]] * 6), None]
  got, n = decode(ps, [12, 12, 12], batch_size=3, drafts=drafts)
  assert got == plain
  solo = [decode([p], [12], batch_size=1, drafts=[d])[1] for p, d in zip(ps, drafts)]
  assert n == max(solo) and len(set(solo)) > 1


def test_refs_stop_under_drafts():
  p = prompts()[0]
  g = reference(p, 12)
  assert len(g) >= 3
  ref = TOK.decode(g[1:3])
  want, _ = decode([p], [12], refs=[(ref,)], batch_size=1)
  got, n = decode([p], [12], refs=[(ref,)], batch_size=1, drafts=[np.asarray(g)])
  assert got == want and len(want[0]) <= 3 and n == 1


def _forward_argmax(prompt, answer):
  """The teacher-forced forward's argmaxes at the answer positions."""
  seq = np.concatenate([prompt, answer]).astype(np.int32)[None]
  index = np.zeros((1, 8), np.int32)
  index[0, : len(answer)] = np.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
  batch = {
    "inputs": seq,
    "positions": np.arange(seq.shape[1])[None],
    "segment_ids": np.ones_like(seq),
    "targets": np.concatenate([seq[:, 1:], seq[:, :1] * 0], axis=1),
    "score_index": index,
    "bucket": np.full_like(seq, -1),
  }
  return logits_scorer(hash_fn)(batch)["argmax"][0, : len(answer)]


def test_argmaxes_of_an_earlier_forward_replace_the_first_call():
  """The teacher-forced forward (prompt + answer) is the first verifying one:
  its argmaxes give the same tokens with fewer calls; none for an answer the
  model gives whose text holds the reference."""
  ps = prompts()
  plain, _ = decode(ps, [12] * len(ps), batch_size=1)
  answers = [np.asarray((g + LETTERS * 2)[:6]) for g in plain[:12]]
  answers += [np.asarray([LETTERS[0]] * 6) for _ in plain[12:]]
  known = [_forward_argmax(p, a) for p, a in zip(ps, answers)]
  kw = dict(batch_size=1, drafts=answers, lookup=True)
  with_drafts, n_drafts = decode(ps, [12] * len(ps), **kw)
  got, n = decode(ps, [12] * len(ps), draft_argmax=known, **kw)
  assert got == with_drafts == plain and n < n_drafts
  checked = 0
  for p in ps:
    g = reference(p, 12)
    if len(g) < 6:
      continue
    checked += 1
    a = np.asarray(g[:6])
    got, n = decode(
      [p],
      [12],
      refs=[(TOK.decode(g[:6]),)],
      draft_argmax=[_forward_argmax(p, a)],
      drafts=[a],
      batch_size=1,
    )
    assert got == [g[:6]] and n == 0
  assert checked >= 3
