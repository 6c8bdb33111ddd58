"""Synthetic retrieval tasks: exact depth, needle removal, seeds, training rows."""

import re

import numpy as np
import pytest

from lctx.data.tokenizers import ByteTokenizer
from lctx.evals import (
  EVAL_SEED_BASE,
  TASKS,
  build_example,
  draw_training_seed,
  eval_seed,
  make_haystack,
  make_training_example,
  training_example_at,
)

TOK = ByteTokenizer()
NOISE = make_haystack("noise", TOK)
TEXT = make_haystack(
  "text",
  TOK,
  [
    "It was the best of times, it was the worst of times. " * 20,
    "Call me Ishmael. Some years ago, never mind how long precisely. " * 20,
  ],
)

NEEDLE_RE = {
  "passkey": r" The pass key is (\d{5})\. Remember it\. \1 is the pass key\. ",
  "niah_single": r" One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\. ",
  "niah_multikey": r" One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\. ",
  "niah_multivalue": r" One of the special magic numbers for [a-z]+-[a-z]+ is: \d{7}\. ",
  "variable_tracking": r" VAR [A-Z]{5} = \d{5}\. ",
}
HELD_OUT_NEEDLE_RE = {
  "passkey": r" The secret code is (\d{5})\. Keep it safe\. \1 is the secret code\. ",
  "niah_single": r" The hidden number that belongs to [a-z]+-[a-z]+ is: \d{7}\. ",
  "niah_multikey": r" The hidden number that belongs to [a-z]+-[a-z]+ is: \d{7}\. ",
  "niah_multivalue": r" The hidden number that belongs to [a-z]+-[a-z]+ is: \d{7}\. ",
  "variable_tracking": r" LET [A-Z]{5} BE \d{5}\. ",
}
# Words of the held-out phrasing that the training phrasing never uses.
HELD_OUT_MARKERS = ("secret code", "hidden number", "LET ", "names holding")


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 1001])
@pytest.mark.parametrize("phrasing", ["train", "held_out"])
def test_depth_placement_is_exact(task, length, phrasing):
  needle_re = (NEEDLE_RE if phrasing == "train" else HELD_OUT_NEEDLE_RE)[task]
  for i, depth in enumerate([0.0, 0.1, 0.37, 0.5, 0.9, 1.0]):
    ex = build_example(task, length, depth, eval_seed(0, task, i), TOK, NOISE, phrasing=phrasing)
    assert ex.phrasing == phrasing
    assert ex.tokens.shape == (length,) and ex.tokens.dtype == np.int32
    assert ex.tokens[0] == TOK.bos_id and ex.body_start == 1
    span = next(s for s in ex.needle_spans if s[0] == ex.depth_offset)
    n = span[1] - span[0]
    # The documented rule, asserted exactly (no tolerance).
    assert ex.depth_offset - ex.body_start == round(depth * (ex.body_len - n))
    assert re.fullmatch(needle_re, TOK.decode(ex.tokens[span[0] : span[1]]))
    if depth == 0.0:
      assert ex.depth_offset == ex.body_start
    if depth == 1.0:
      assert span[1] == ex.body_start + ex.body_len
    # The answer is the tail of the sequence.
    assert TOK.decode(ex.tokens[ex.answer_start :]) == ex.answer


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("haystack", [NOISE, TEXT])
def test_needle_removed_control(task, haystack):
  for i, depth in enumerate([0.0, 0.5, 1.0]):
    seed = eval_seed(1, task, i)
    ex = build_example(task, 512, depth, seed, TOK, haystack)
    ctl = build_example(task, 512, depth, seed, TOK, haystack, needle_removed=True)
    assert ctl.needle_removed and ctl.tokens.shape == ex.tokens.shape
    assert ctl.answer == ex.answer and ctl.needle_spans == ex.needle_spans
    # Same question and answer, same tokens before the first removed needle.
    first = min(s for s, _ in ex.needle_spans)
    np.testing.assert_array_equal(ctl.tokens[:first], ex.tokens[:first])
    np.testing.assert_array_equal(
      ctl.tokens[ctl.body_start + ctl.body_len :], ex.tokens[ex.body_start + ex.body_len :]
    )
    body = lambda e: TOK.decode(e.tokens[e.body_start : e.body_start + e.body_len])
    context = lambda e: TOK.decode(e.tokens[: e.answer_start])
    for item in ex.answer_items:
      assert item in body(ex)
      assert item not in context(ctl), (task, item)
    for s, e in ex.needle_spans:
      assert TOK.decode(ex.tokens[s:e]) not in body(ctl)


def test_distractors_and_multivalue_order():
  ex = build_example("niah_multikey", 1024, 0.5, eval_seed(2), TOK, NOISE)
  text = TOK.decode(ex.tokens[: ex.answer_start])
  values = re.findall(r"is: (\d{7})\.", text)
  assert len(values) == 4 and len(set(values)) == 4 and ex.answer.strip() in values
  ex = build_example("niah_multivalue", 1024, 0.5, eval_seed(3), TOK, NOISE)
  text = TOK.decode(ex.tokens[: ex.answer_start])
  assert ex.answer == " " + ", ".join(re.findall(r"is: (\d{7})\.", text))
  ex = build_example("variable_tracking", 1024, 0.2, eval_seed(4), TOK, NOISE)
  text = TOK.decode(ex.tokens[: ex.answer_start])
  value = re.search(r"VAR [A-Z]{5} = (\d{5})\.", text).group(1)
  chain = {b: a for b, a in re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})", text)}
  names = ex.answer.split()
  assert re.search(rf"VAR {names[0]} = {value}\.", text)
  assert all(chain[b] == a for a, b in zip(names[:-1], names[1:]))


def test_reproducible_and_seed_dependent():
  a = build_example("passkey", 300, 0.3, eval_seed(0, "x"), TOK, TEXT)
  b = build_example("passkey", 300, 0.3, eval_seed(0, "x"), TOK, TEXT)
  c = build_example("passkey", 300, 0.3, eval_seed(0, "y"), TOK, TEXT)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


def test_train_and_eval_seeds_are_disjoint():
  rng = np.random.default_rng(0)
  train = {draw_training_seed(rng) for _ in range(2000)}
  evals = {
    eval_seed(s, t, n, d, k)
    for s in range(3)
    for t in TASKS
    for n in (256, 512)
    for d in range(5)
    for k in range(4)
  }
  assert len(evals) == 3 * len(TASKS) * 2 * 5 * 4  # no collisions between cells
  assert max(train) < EVAL_SEED_BASE <= min(evals)
  assert max(evals) < 2**63
  for task in TASKS:
    row = make_training_example(task, 512, rng)
    assert int(row["seed"]) < EVAL_SEED_BASE
    a = training_example_at(task, 512, 3, seed=1)
    b = training_example_at(task, 512, 3, seed=1)
    c = training_example_at(task, 512, 4, seed=1)
    assert int(a["seed"]) == int(b["seed"]) < EVAL_SEED_BASE
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_held_out_phrasing_never_reaches_training():
  for task in TASKS:
    for index in range(40):
      text = TOK.decode(training_example_at(task, 512, index, seed=3)["inputs"])
      assert not any(m in text for m in HELD_OUT_MARKERS), (task, text)
    ex = build_example(task, 1024, 0.5, eval_seed(5, task), TOK, NOISE, phrasing="held_out")
    context = TOK.decode(ex.tokens[: ex.answer_start])
    assert any(m in context for m in HELD_OUT_MARKERS)
    assert "pass key" not in context and "magic number" not in context
    assert "VAR " not in context
    ctl = build_example(
      task, 1024, 0.5, eval_seed(5, task), TOK, NOISE, phrasing="held_out", needle_removed=True
    )
    for item in ex.answer_items:
      assert item in context and item not in TOK.decode(ctl.tokens[: ctl.answer_start])


@pytest.mark.parametrize("answer_loss_only", [False, True])
def test_training_example_row(answer_loss_only):
  row = make_training_example(
    "niah_single", 400, np.random.default_rng(5), TOK, answer_loss_only=answer_loss_only
  )
  assert all(
    row[k].shape == (400,) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")
  )
  np.testing.assert_array_equal(row["targets"][:-1], row["inputs"][1:])
  assert row["targets"][-1] == TOK.eos_id
  text = TOK.decode(row["inputs"])
  assert "magic number" in text and "The grass is green." in text
  a = int(row["answer_start"])
  if answer_loss_only:
    # Loss exactly on the positions whose targets are the answer tokens.
    np.testing.assert_array_equal(np.nonzero(row["loss_mask"])[0], np.arange(a - 1, 399))
  else:
    assert row["loss_mask"].min() == 1.0


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="length 200 leaves"):
    build_example("niah_multikey", 200, 0.5, 1, TOK, NOISE)
  with pytest.raises(ValueError, match="depth must be"):
    build_example("passkey", 512, 1.5, 1, TOK, NOISE)
  with pytest.raises(ValueError, match="unknown task"):
    build_example("nope", 512, 0.5, 1, TOK, NOISE)
  with pytest.raises(ValueError, match="unknown phrasing"):
    build_example("passkey", 512, 0.5, 1, TOK, NOISE, phrasing="fancy")
  with pytest.raises(ValueError, match="needs documents"):
    make_haystack("text", TOK)
