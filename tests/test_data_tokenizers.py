"""Tokenizers: byte ids, special ids, invalid UTF-8, SentencePiece training."""

import os
import subprocess
import sys

import numpy as np
import pytest

from lctx.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_byte_ids_and_roundtrip():
  tok = make_tokenizer("byte")
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 259)
  assert tok.encode("A") == [ord("A") + 3]
  text = "héllo, wörld 😀\n\ttabs"
  ids = tok.encode(text)
  assert len(ids) == len(text.encode("utf-8"))
  assert min(ids) >= 3 and max(ids) < 259
  assert tok.decode(ids) == text
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text


def test_byte_invalid_utf8_never_crashes():
  tok = ByteTokenizer()
  ids = tok.encode_bytes(b"ok\xff\xfe mid \xe2\x82")  # invalid + truncated
  out = tok.decode(ids)
  assert out.startswith("ok") and "\ufffd" in out and " mid " in out
  # Out-of-range ids are skipped, not an error.
  assert tok.decode([-5, 10_000, ord("x") + 3]) == "x"
  # Lone surrogates in a str encode instead of raising.
  assert len(tok.encode("a\ud800b")) == 5


def test_unknown_tokenizer_is_clear_error():
  with pytest.raises(ValueError, match="unknown tokenizer"):
    make_tokenizer("wordpiece")
  with pytest.raises(ValueError, match="model_path"):
    make_tokenizer("sentencepiece")
  with pytest.raises(ValueError, match="train_sentencepiece"):
    SentencePieceTokenizer("/nonexistent/x.model")


def test_train_and_load_sentencepiece(tmp_path):
  docs = tmp_path / "docs"
  docs.mkdir()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "self", "lambda"]
  for i in range(5):
    lines = [" ".join(rng.choice(words, 12)) for _ in range(200)]
    (docs / f"d{i}.txt").write_text("\n".join(lines))
  prefix = tmp_path / "spm"
  subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "scripts/train_sentencepiece.py"),
      f"--output_prefix={prefix}",
      f"--text_glob={docs}",
      "--vocab_size=300",
    ],
    check=True,
    timeout=120,
  )
  tok = make_tokenizer("sentencepiece", f"{prefix}.model")
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 300)
  text = "def alpha(self):\n    return gamma  ünïcode"
  ids = tok.encode(text)
  assert all(i > 2 for i in ids)
  assert len(ids) < len(text.encode())  # it actually merges pieces
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text


def test_sentencepiece_through_the_pipeline(tmp_path):
  from lctx.data.pipeline import DataConfig, make_iterator

  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(4):
    (docs / f"d{i}.txt").write_text(f"doc {i}: " + "the quick brown fox jumps. " * (30 + 20 * i))
  prefix = tmp_path / "spm"
  subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, "scripts/train_sentencepiece.py"),
      f"--output_prefix={prefix}",
      f"--text_glob={docs}",
      "--vocab_size=320",
    ],
    check=True,
    timeout=120,
  )
  config = DataConfig(
    text_glob=str(docs),
    data_dir=str(tmp_path / "cache"),
    tokenizer="sentencepiece",
    tokenizer_model_path=f"{prefix}.model",
    num_packing_bins=4,
    window_shuffle_size=1,
    validation_fraction=0.3,
  )
  batch = next(
    make_iterator(config, batch_size=2, seq_len=128, seed=0, process_index=0, process_count=1)
  )
  tok = make_tokenizer("sentencepiece", f"{prefix}.model")
  assert batch["inputs"].max() < tok.vocab_size
  assert "quick brown fox" in tok.decode(batch["inputs"][0])
  real = batch["segment_ids"] > 0
  assert (batch["inputs"][real] == tok.bos_id).sum() >= 1  # documents start with BOS
