"""RULER-format task files: a jsonl round trip through run_evals, and bad lines."""

import json
import os

import numpy as np
import pytest

from lctx.data.tokenizers import ByteTokenizer
from lctx.evals import EvalConfig, run_evals
from lctx.evals.task_files import read_task_file

TOK = ByteTokenizer()
E = TOK.vocab_size
SEVEN = TOK.encode("7")[0]


def copy_but_never_seven(batch):
  """Puts all mass on the true next input token, except that it predicts '8'
  where the next token is '7': answers holding a 7 are missed."""
  x = batch["inputs"]
  nxt = np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], axis=1)
  nxt = np.where(nxt == SEVEN, SEVEN + 1, nxt)
  out = np.zeros(x.shape + (E,), np.float32)
  np.put_along_axis(out, nxt[..., None], 10.0, axis=-1)
  return out


LINES = [
  {"index": 0, "input": "The magic number is 123. What is it?", "outputs": ["123"], "length": 64},
  {
    "index": 1,
    "input": "Numbers: 45 and 67. Which are they?",
    "outputs": ["45", "67"],
    "length": 64,
    "answer_prefix": " They are",
  },
  {"index": 2, "input": "x " * 40 + "The code is 9.", "outputs": ["9"], "length": 128},
]


def _write(path, lines, extra=()):
  with open(path, "w") as f:
    for line in lines:
      f.write(json.dumps(line) + "\n")
    for text in extra:
      f.write(text + "\n")
  return str(path)


def test_a_ruler_file_is_scored_beside_the_built_in_tasks(tmp_path):
  path = _write(tmp_path / "niah_toy.jsonl", LINES)
  cfg = EvalConfig(
    tasks=("passkey",),
    lengths=(128,),
    depths=(0.5,),
    samples_per_cell=1,
    batch_size=2,
    length_multiple=8,
    window=0,
    task_files=(path,),
  )
  workdir = tmp_path / "run"
  metrics = run_evals(copy_but_never_seven, TOK, config=cfg, workdir=str(workdir), step=3)
  with open(workdir / "evals" / "retrieval.json") as f:
    records = [r for r in json.load(f) if r["task"] == "niah_toy"]
  by_length = {r["length"]: r for r in records}
  assert sorted(by_length) == [64, 128]
  # Line 0 matched; line 1 matched "45" but not "67": RULER's string_match_all
  # averages over a line's outputs, so 0.5; their mean at length 64 is 0.75.
  assert by_length[64]["accuracy"] == 0.75 and by_length[64]["n"] == 2
  assert by_length[128]["accuracy"] == 1.0 and by_length[128]["depth"] is None
  assert metrics["eval/niah_toy/acc"] == pytest.approx((0.75 + 1.0) / 2)
  assert metrics["eval/niah_toy/acc_len64"] == 0.75
  # The built-in mean stays over the built-in tasks.
  assert metrics["eval/retrieval/acc"] == metrics["eval/passkey/acc"]
  assert os.path.exists(workdir / "evals" / "retrieval_niah_toy.png")
  with open(workdir / "evals" / "summary.md") as f:
    assert "## niah_toy" in f.read()


def test_a_malformed_line_names_the_file_and_line(tmp_path):
  path = _write(tmp_path / "bad.jsonl", LINES[:2], extra=['{"input": "x", "outputs": '])
  with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: not a JSON object"):
    read_task_file(path)
  path = _write(tmp_path / "bad2.jsonl", [LINES[0], {"input": "x", "outputs": []}])
  with pytest.raises(ValueError, match=r"bad2\.jsonl, line 2: 'outputs' must be a non-empty list"):
    read_task_file(path)
  path = _write(tmp_path / "bad3.jsonl", [{"outputs": ["1"]}])
  with pytest.raises(ValueError, match=r"bad3\.jsonl, line 1: 'input' must be a string"):
    read_task_file(path)


def test_a_file_named_like_a_built_in_task_is_refused(tmp_path):
  with pytest.raises(ValueError, match="repeat a built-in task"):
    EvalConfig(tasks=("passkey",), task_files=(str(tmp_path / "passkey.jsonl"),))
