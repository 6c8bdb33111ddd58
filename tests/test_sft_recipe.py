"""The CPU SFT recipe's data and its metric (scripts/make_sft_data.py,
scripts/sft_accuracy.py): the loss covers exactly the assistant turns, and the
held-out accuracy reads the logits at j - 1 for answer token j, as training
does. An oracle scores 1, the same oracle one position late scores 0."""

import importlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from lctx.data import chat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IM_END, NEWLINE = 260, ord("\n") + 3  # the recipe's ids: byte b -> b + 3


def _byte_ids(text):
  return [b + 3 for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp("sft_data")
  subprocess.run(
    [sys.executable, os.path.join(ROOT, "scripts/make_sft_data.py"), f"--out={out}"]
    + ["--train=4", "--heldout=12"],
    check=True,
    capture_output=True,
  )
  with open(out / "heldout.jsonl") as f:
    rows = [json.loads(line)["messages"] for line in f]
  return str(out / "tokenizer"), rows


@pytest.fixture(scope="module")
def accuracy():
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  try:
    return importlib.import_module("sft_accuracy")
  finally:
    sys.path.pop(0)


def test_supervised_tokens_are_the_assistant_turns(data):
  path, rows = data
  for messages in rows:
    ids, mask = chat.encode_chat(messages, path)
    kept, value = messages[2]["content"], messages[4]["content"]
    answer = _byte_ids(value) + [IM_END, NEWLINE]
    assert ids[mask > 0].tolist() == _byte_ids(kept) + [IM_END, NEWLINE] + answer
    assert ids[-len(answer) :].tolist() == answer  # the answer ends the conversation
    # The value is in the document two turns earlier, after its key.
    key = messages[3]["content"].removeprefix("Value of ").removesuffix("?")
    assert f"{key}: {value}" in messages[1]["content"]


def _oracle(rows, path, shift=0, wrong=()):
  """A logits_fn whose argmax at position j - 1 + shift is token j of each
  conversation; in the conversations numbered in `wrong`, the answer's first
  digit is predicted wrong."""
  encoded = [chat.encode_chat(m, path)[0] for m in rows]
  calls = iter(range(0, len(rows), 8))

  def fn(batch):
    start = next(calls)
    b, seq = batch["inputs"].shape
    logits = np.zeros((b, seq, 384), np.float32)
    for r in range(b):
      if start + r >= len(rows):
        break
      ids = encoded[start + r]
      np.testing.assert_array_equal(batch["inputs"][r, : len(ids) - 1], ids[:-1])
      for j in range(1, len(ids)):
        if 0 <= j - 1 + shift < seq:
          logits[r, j - 1 + shift, ids[j]] = 1.0
      if start + r in wrong:
        j = len(ids) - 6  # the first digit of the 4-digit answer
        logits[r, j - 1, ids[j]] = 0.0
        digit = ids[j] - 3 - ord("0")
        logits[r, j - 1, (digit + 1) % 10 + ord("0") + 3] = 1.0
    return logits

  return fn


def test_accuracy_reads_the_answer_where_training_predicts_it(data, accuracy):
  path, rows = data
  train = types.SimpleNamespace(batch_size=8, seq_len=512)
  right = accuracy.score(rows, path, _oracle(rows, path), train)
  assert right["conversations"] == len(rows) == 12
  assert right["answer_accuracy"] == 1.0 and right["answer_token_accuracy"] == 1.0
  assert right["by_position"] == [1.0] * 6  # 4 digits, <|im_end|>, newline
  late = accuracy.score(rows, path, _oracle(rows, path, shift=1), train)
  # One position late, token j is predicted where j - 1 was: right only where
  # the two are equal (a repeated digit).
  encoded = [chat.encode_chat(m, path)[0] for m in rows]
  repeats = sum(int(ids[j - 1] == ids[j]) for ids in encoded for j in range(len(ids) - 6, len(ids)))
  assert late["answer_accuracy"] == 0.0
  np.testing.assert_allclose(late["answer_token_accuracy"], repeats / 72, atol=1e-4)
  wrong = accuracy.score(rows, path, _oracle(rows, path, wrong={0, 5, 9}), train)
  assert wrong["answer_accuracy"] == 9 / 12
  assert wrong["by_position"] == [0.75] + [1.0] * 5
  np.testing.assert_allclose(wrong["answer_token_accuracy"], 1 - 3 / 72, atol=1e-4)
