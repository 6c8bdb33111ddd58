"""RULER prompts as text, RULER's tasks and metrics, generation scores and the
effective length (lctx/evals/ruler.py, prompts.py, generate.py, grid.py)."""

import collections
import json
import re

import numpy as np
import pytest

from lctx.data.tokenizers import ByteTokenizer, HFTokenizer
from lctx.evals import EvalConfig, ruler, run_evals
from lctx.evals.generate import generation_scores, greedy_decode
from lctx.evals.grid import effective_length
from lctx.evals.prompts import RULER_NOISE, build_text_example, make_text_haystack

TOK = ByteTokenizer()
E = TOK.vocab_size
NOISE = make_text_haystack("noise")
PROSE = (
  "The harbor was quiet that morning. Boats rocked at their moorings!\n"
  "def f(x):\n    return x + 1\n"
  "Gulls circled over the old pier. Nobody spoke? A bell rang twice.\n"
)


def _bpe(tmp_path):
  """A byte-level BPE trained on RULER-like text (merges cross the needles'
  words), saved as a tokenizer.json directory."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  corpus = [RULER_NOISE, PROSE] * 50
  corpus += ["One of the special magic numbers for amber-apple is: 1234567."] * 50
  trainer = trainers.BpeTrainer(
    vocab_size=500,
    special_tokens=["<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer)
  path = tmp_path / "bpe"
  path.mkdir()
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  return HFTokenizer(str(path))


# ----------------------------------------------------------------------------
# Prompts as text
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("tokenizer_kind", ["byte", "bpe"])
def test_prompt_ids_are_the_tokenizers_encoding_of_the_whole_string(tokenizer_kind, tmp_path):
  tok = TOK if tokenizer_kind == "byte" else _bpe(tmp_path)
  for hs in (NOISE, make_text_haystack("text", [PROSE * 20])):
    for depth in (0.0, 0.5, 1.0):
      ex = build_text_example("niah_single", 1024, depth, 7, tok, hs, reserve=16)
      assert list(ex.tokens[1 : ex.answer_start]) == list(tok.encode(ex.prompt))
      assert ex.tokens[0] == tok.bos_id and len(ex.tokens) <= 1024
      assert ex.answer_start + 16 <= 1024  # room to decode the budget
      # the needle is a line of its own: inserted between units, never inside one
      (needle,) = [line for line in ex.prompt.split("\n") if "special magic numbers for" in line]
      assert needle.startswith("One of the special magic numbers for ") and needle.endswith(".")
      (s, e) = ex.needle_spans[0]
      assert tok.decode(ex.tokens[s:e]).strip() == needle
      assert ex.prompt.endswith("mentioned in the provided text is")


def test_depth_is_measured_in_tokens_of_the_tokenized_prompt():
  offsets = []
  for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
    ex = build_text_example("passkey", 2048, depth, 3, TOK, NOISE)
    s, e = ex.needle_spans[0]
    room = ex.body_len - (e - s)
    got = (ex.depth_offset - ex.body_start) / room
    line = len(RULER_NOISE) + 1  # one noise line in bytes: the boundaries' step
    assert abs(got - depth) * room <= line / 2 + 1, (depth, got)
    offsets.append(ex.depth_offset)
  assert offsets == sorted(offsets) and offsets[0] == ex.body_start


def test_needle_removed_control_is_the_same_example_without_the_needles():
  for task in ("passkey", "niah_multivalue", "variable_tracking"):
    ex = build_text_example(task, 1024, 0.5, 11, TOK, NOISE)
    ctl = build_text_example(task, 1024, 0.5, 11, TOK, NOISE, needle_removed=True)
    assert ctl.answer_items == ex.answer_items
    kept = [ln for ln in ex.prompt.split("\n") if not any(i in ln for i in ex.answer_items)]
    assert ctl.prompt.split("\n") == kept
    for item in ex.answer_items:
      assert item in ex.prompt and item not in ctl.prompt.split("\n", 1)[1].rsplit("\n", 1)[0]


# ----------------------------------------------------------------------------
# The tasks
# ----------------------------------------------------------------------------
def _context(ex):
  return ex.prompt.split("\n", 1)[1].rsplit("\n", 1)[0]


def test_niah_variants_follow_ruler():
  rng = np.random.default_rng(0)
  for task, n_needles, n_out in (
    ("niah_single", 1, 1),
    ("niah_multikey", 4, 1),
    ("niah_multivalue", 4, 4),
    ("niah_multiquery", 4, 4),
  ):
    spec = ruler.draw_spec(task, rng)
    assert len(spec.needles) == n_needles and len(spec.outputs) == n_out
    assert sum(n.queried for n in spec.needles) == n_out
    assert sum(n.at_depth for n in spec.needles) == 1
    singular = n_out == 1
    assert spec.head.startswith("A special magic number is" if singular else "Some special")
    assert spec.answer_prefix.endswith(" is" if singular else " are")
  spec = ruler.draw_spec("niah_multiquery", rng)
  keys = re.findall(r"for (\S+) is:", " ".join(n.text for n in spec.needles))
  assert all(k in spec.tail for k in keys) and ", and " in spec.tail
  for kinds, pattern in (
    (("uuids", "uuids"), r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"),
    (("numbers", "words"), r"[a-z]+-[a-z]+"),
  ):
    spec = ruler.draw_spec("niah_single", rng, kinds=kinds)
    assert re.fullmatch(pattern, spec.outputs[0]), spec.outputs
    assert f"special magic {kinds[1][:-1]} for" in spec.tail


def test_needle_haystack_is_distractor_needles():
  ex = build_text_example("niah_multikey", 1024, 0.5, 5, TOK, make_text_haystack("needle"))
  lines = _context(ex).split("\n")
  assert len(lines) > 8
  assert all(ln.startswith("One of the special magic numbers for ") for ln in lines)
  (value,) = ex.answer_items
  assert sum(value in ln for ln in lines) == 1


def test_variable_tracking_chain_in_order():
  ex = build_text_example("variable_tracking", 2048, 0.25, 9, TOK, NOISE)
  names = ex.answer_items
  lines = [ln for ln in _context(ex).split("\n") if ln.startswith("VAR ")]
  assert len(lines) == 5 and lines[0].startswith(f"VAR {names[0]} = ")
  for a, b, ln in zip(names, names[1:], lines[1:]):
    assert ln.strip() == f"VAR {b} = VAR {a}"
  assert ex.answer == ", ".join(names)


def test_cwe_counts():
  ex = build_text_example("cwe", 8192, None, 4, TOK, NOISE)
  words = re.findall(r"\d+\. (\S+)", _context(ex))
  counts = collections.Counter(words)
  assert sorted(counts[w] for w in ex.answer_items) == [30] * 10
  assert {c for w, c in counts.items() if w not in ex.answer_items} == {3}
  assert [int(n) for n in re.findall(r"(\d+)\. ", _context(ex))] == list(range(1, len(words) + 1))
  assert ex.depth is None and ex.needle_spans == ()


def test_fwe_answer_is_ranks_two_to_four():
  ex = build_text_example("fwe", 4096, None, 4, TOK, NOISE)
  context = ex.prompt.split("coded words. ", 1)[1].rsplit("\nQuestion", 1)[0]
  counts = collections.Counter(context.split(" ")).most_common()
  assert counts[0][0] == "..."
  assert tuple(w for w, _ in counts[1:4]) == ex.answer_items
  assert counts[3][1] > counts[4][1]  # the third is strictly ahead of the fourth


# ----------------------------------------------------------------------------
# RULER's metrics on hand-written outputs
# ----------------------------------------------------------------------------
def test_string_match_metrics():
  preds = ["The numbers are 123 and 456.", "nothing", "  UUID ABC-def\x01  "]
  refs = [["123", "456", "789"], ["x"], ["abc-DEF"]]
  assert ruler.string_match_all(preds, refs) == round((2 / 3 + 0 + 1) / 3 * 100, 2)
  assert ruler.string_match_part(preds, refs) == round((1 + 0 + 1) / 3 * 100, 2)
  assert ruler.example_score(preds[0], refs[0], "all") == pytest.approx(2 / 3)
  assert ruler.example_score(preds[0], refs[0], "part") == 1.0
  assert ruler.postprocess_pred(" a\tb\x00 ") == "a\nb"


@pytest.mark.parametrize("task", ruler.TEXT_TASKS)
def test_each_task_scores_hand_written_outputs(task):
  length = 8192 if task in ("cwe", "fwe") else 1024
  ex = build_text_example(task, length, 0.5, 21, TOK, NOISE)
  items = ex.answer_items
  assert ruler.example_score(ex.answer, items) == 1.0  # the teacher-forced answer
  full = " " + " and ".join(i.upper() for i in items) + ". More text."
  assert ruler.example_score(full, items) == 1.0  # any case, anywhere
  if len(items) > 1:
    half = ", ".join(items[: len(items) // 2])
    assert ruler.example_score(half, items) == pytest.approx((len(items) // 2) / len(items))
    assert ruler.example_score(half, items, "part") == 1.0
  assert ruler.example_score("I do not know.", items) == 0.0


# ----------------------------------------------------------------------------
# Generation scores
# ----------------------------------------------------------------------------
def induction_fn(batch, max_match=24):
  """An induction head over the last 40 positions of each row: the longest
  earlier match of the current suffix predicts what followed it; EOS after a
  sentence end ('.'); uniform elsewhere. It answers a passkey prompt as a
  model trained to retrieve does."""
  x = batch["inputs"]
  out = np.zeros(x.shape + (E,), np.float32)
  for r, n in enumerate((batch["segment_ids"] > 0).sum(axis=1)):
    s = "".join(chr(0x100 + int(i)) for i in x[r, :n])
    for t in range(max(1, n - 40), n):
      if x[r, t] == ord(".") + 3:
        out[r, t, TOK.eos_id] = 10.0
        continue
      for k in range(min(max_match, t), 0, -1):
        j = s.rfind(s[t - k + 1 : t + 1], 0, t)
        if j >= 0:
          out[r, t, x[r, j + k]] = 10.0
          break
  return out


def test_greedy_decode_stops_at_eos_budget_and_match():
  prompt = np.asarray(TOK.encode("ab. ab. a"), np.int32)
  ((ids, text),) = greedy_decode(induction_fn, [prompt], [10], TOK, batch_size=2)
  assert text == "b." and list(ids) == TOK.encode("b.")  # then EOS, not kept
  ((_, text),) = greedy_decode(induction_fn, [prompt], [1], TOK, batch_size=2)
  assert text == "b"  # the budget
  ((_, text),) = greedy_decode(induction_fn, [prompt], [10], TOK, refs=[("B",)], batch_size=2)
  assert text == "b"  # stopped once the reference is in (the same score)


def test_generation_and_teacher_forced_scores_agree_on_a_model_that_answers():
  exs = [
    build_text_example("passkey", 512, d, 30 + i, TOK, NOISE, reserve=16)
    for i, d in enumerate((0, 0.5, 1))
  ]
  ctl = [build_text_example("passkey", 512, 0.5, 40, TOK, NOISE, needle_removed=True, reserve=16)]
  from lctx.evals.scoring import score_answers

  tf = score_answers(induction_fn, exs + ctl, batch_size=4)
  gen = generation_scores(induction_fn, exs + ctl, TOK, max_new_tokens=16, batch_size=4)
  assert [s["exact"] for s in tf] == [1.0, 1.0, 1.0, 0.0]
  assert [g["generation_score"] for g in gen] == [1.0, 1.0, 1.0, 0.0]


def _copy_fn(batch):
  """Cheats under teacher forcing (predicts the next input), emits pad when decoding."""
  x = batch["inputs"]
  out = np.zeros(x.shape + (E,), np.float32)
  nxt = np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], axis=1)
  np.put_along_axis(out, nxt[..., None], 10.0, axis=-1)
  return out


def test_run_evals_writes_both_scores_disagreement_and_effective_length(tmp_path):
  cfg = EvalConfig(
    prompts="ruler",
    tasks=ruler.TEXT_TASKS,
    lengths=(640, 1024),
    depths=(0.0, 1.0),
    samples_per_cell=1,
    batch_size=4,
    length_multiple=8,
    window=0,
    held_out_haystack="none",
    held_out_phrasing=False,
    generation_tokens=8,
    # _copy_fn reads the next input, so it is not causal: the draft-verified
    # path (which assumes a causal model) would see its draft copied back.
    draft_decoding=False,
  )
  metrics = run_evals(_copy_fn, TOK, config=cfg, workdir=str(tmp_path), step=3, write_files=True)
  with open(tmp_path / "evals" / "retrieval.json") as f:
    records = json.load(f)
  main = [r for r in records if not r["needle_removed"]]
  assert {r["task"] for r in main} >= {"passkey", "niah_multiquery", "variable_tracking"}
  for r in main:
    assert r["accuracy"] == 1.0 and r["generation_score"] == 0.0 and r["disagree"] == 1.0, r
  assert metrics["eval/generation/disagree"] > 0.5
  assert metrics["eval/effective_length"] == 0.0
  with open(tmp_path / "evals" / "metrics.json") as f:
    assert json.load(f)["eval/effective_length"] == 0.0
  summary = (tmp_path / "evals" / "summary.md").read_text()
  assert "effective length: 0" in summary and "disagree on" in summary
  assert (tmp_path / "evals" / "effective_length.png").stat().st_size > 0


# ----------------------------------------------------------------------------
# The effective length
# ----------------------------------------------------------------------------
def _rec(task, length, score, depth=0.5, **kw):
  return {
    "task": task,
    "length": length,
    "depth": depth,
    "generation_score": score,
    "needle_removed": False,
    "held_out": False,
    **kw,
  }


def test_effective_length_on_a_fixture():
  records = [
    _rec("a", 1024, 1.0),
    _rec("b", 1024, 0.9),  # 95.0
    _rec("a", 2048, 1.0),
    _rec("b", 2048, 0.7),
    _rec("b", 2048, 0.8, depth=1.0),  # (100 + 75) / 2
    _rec("a", 4096, 0.9),
    _rec("b", 4096, 0.812),  # 85.6 exactly: passes
    _rec("a", 8192, 0.5),
    _rec("b", 8192, 0.5),
    _rec("a", 8192, 1.0, needle_removed=True),
    _rec("a", 8192, 1.0, held_out=True),  # ignored
  ]
  eff, by_length = effective_length(records)
  assert by_length == pytest.approx({1024: 95.0, 2048: 87.5, 4096: 85.6, 8192: 50.0})
  assert eff == 4096
  assert effective_length(records[:2], threshold=96.0) == (0, {1024: pytest.approx(95.0)})


def test_chat_prompts_are_the_models_template_as_transformers_renders_it(tmp_path):
  """EvalConfig.chat renders the user's turn with lctx.data.chat (the SFT code):
  equal to transformers' apply_chat_template with the generation prompt, then
  the answer prefix; without a template it is a ConfigError, not plain text."""
  import helpers
  import transformers

  from lctx.data.tokenizers import HFTokenizer
  from lctx.errors import ConfigError
  from lctx.evals.prompts import render_prompt

  tok = _bpe(tmp_path)
  assert render_prompt("Q?", " A:", tok, chat=False) == "Q? A:"
  with pytest.raises(ConfigError, match="no chat template"):
    render_prompt("Q?", " A:", tok, chat=True)
  for family in ("llama31", "qwen3"):
    path = helpers.save_chat_tokenizer(str(tmp_path / family), family)
    user = "document: alpha beta key=gamma\nwhat is the key?"
    got = render_prompt(user, " The key is", HFTokenizer(path), chat=True)
    want = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
      [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert got == want + " The key is", family


def test_task_files_get_rulers_metric_by_name(tmp_path):
  """A file named qa_* is scored with string_match_part, any other with _all."""
  from lctx.evals.task_files import run_task_files

  line = {"input": "Q: which city? The answer is Paris. Answer:", "outputs": ["Paris", "Lyon"]}
  line["answer_prefix"] = " The answer is"
  paths = []
  for name in ("qa_city.jsonl", "city.jsonl"):
    (tmp_path / name).write_text(json.dumps(line) + "\n")
    paths.append(str(tmp_path / name))
  qa, other = run_task_files(induction_fn, TOK, paths, batch_size=2, generate_tokens=8)
  assert (qa["generation_score"], other["generation_score"]) == (1.0, 0.5)
  assert qa["accuracy"] == other["accuracy"] == 0.5  # " Paris" is teacher-forced, " Lyon" not
