"""Tokenizers: byte ids, special ids, invalid UTF-8, SentencePiece training."""

import json
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
  with pytest.raises(ValueError, match="unknown tokenizer .wordpiece.; expected one of"):
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


# ----------------------------------------------------------------------------
# Pad decoupled from id 0: a Llama 2 / Mistral style SentencePiece model (no pad)
# ----------------------------------------------------------------------------
def test_sentencepiece_without_a_pad_piece_loads(tmp_path):
  import sentencepiece as spm

  rng = np.random.default_rng(1)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "self", "lambda"]
  lines = [" ".join(rng.choice(words, 10)) for _ in range(300)]
  prefix = str(tmp_path / "llama2_style")
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_prefix=prefix,
    vocab_size=320,  # byte fallback's 256 pieces + merges
    model_type="bpe",
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,  # as Llama 2 and Mistral ship
    byte_fallback=True,
    minloglevel=2,
  )
  tok = make_tokenizer("sentencepiece", f"{prefix}.model")
  reference = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
  assert reference.pad_id() == -1
  assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 320)
  assert tok.pad_id == 0  # any valid id: pad cells are marked by segment id 0
  text = "def alpha(self): return gamma"
  ids = tok.encode(text)
  assert ids == reference.encode(text)
  assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == reference.decode(ids)


def test_sentencepiece_without_bos_is_refused(tmp_path):
  import sentencepiece as spm

  rng = np.random.default_rng(2)
  words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "return"]
  lines = [" ".join(rng.choice(words, 10)) for _ in range(200)]
  prefix = str(tmp_path / "no_bos")
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_prefix=prefix,
    vocab_size=60,
    model_type="bpe",
    unk_id=0,
    bos_id=-1,
    eos_id=1,
    pad_id=-1,
    minloglevel=2,
  )
  with pytest.raises(ValueError, match=r"no_bos\.model has bos=-1, eos=1"):
    make_tokenizer("sentencepiece", f"{prefix}.model")


# ----------------------------------------------------------------------------
# Hugging Face tokenizer.json (the tokenizers library)
# ----------------------------------------------------------------------------
TEXTS = [
  "def alpha(self):\n    return gamma  ünïcode 😀",
  "  leading spaces, tabs\tand\n\nnewlines ",
  "numbers 1234567 and 0.5e-3 in the text",
  "",
]


def _bpe_tokenizer_json(tmp_path, *, bos="<|begin_of_text|>", pad=None):
  """A byte-level BPE trained here with the tokenizers library, whose own
  post-processor adds BOS (as Llama 3's does), saved by transformers."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<pad>"]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "return", "def", "self", "lambda", "über", "naïve"]
  corpus = [" ".join(rng.choice(words, 12)) for _ in range(300)]
  trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=specials,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer)
  bos_id = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
  )
  path = tmp_path / "hf_tokenizer"
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token=bos, eos_token="<|end_of_text|>", pad_token=pad
  ).save_pretrained(str(path))
  return str(path)


def test_hf_tokenizer_ids_equal_the_tokenizers_librarys(tmp_path):
  import tokenizers
  import transformers

  path = _bpe_tokenizer_json(tmp_path)
  reference = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  for model_path in (path, os.path.join(path, "tokenizer.json")):
    tok = make_tokenizer("hf", model_path)
    for text in TEXTS:
      ids = tok.encode(text)
      assert ids == reference.encode(text, add_special_tokens=False).ids, text
      assert tok.decode(ids) == text
      assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text  # special ids skipped
    assert reference.encode("alpha").ids[0] == tok.bos_id  # its own BOS: not added by lctx
    # A special token's text inside a document is that token, as in tokenizers.
    text = "a <|end_of_text|> b"
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tok.eos_id in tok.encode(text)
  assert tok.vocab_size == reference.get_vocab_size() > 256 + 3  # bytes, specials, merges
  assert tok.encode("alpha beta gamma") != list(b"alpha beta gamma")  # merges happen
  # BOS/EOS as transformers reads them from the same files.
  auto = transformers.AutoTokenizer.from_pretrained(path)
  assert (tok.bos_id, tok.eos_id) == (auto.bos_token_id, auto.eos_token_id)
  assert tok.pad_id == 0  # no pad token
  assert tok.decode([-1, 10_000, *tok.encode("x")]) == "x"  # out of range: skipped


def test_hf_tokenizer_special_ids_from_each_file(tmp_path):
  import transformers

  path = _bpe_tokenizer_json(tmp_path, pad="<pad>")
  auto = transformers.AutoTokenizer.from_pretrained(path)
  assert make_tokenizer("hf", path).pad_id == auto.pad_token_id == 2
  # Qwen style: no BOS token anywhere -> documents start with EOS.
  config = json.loads(open(os.path.join(path, "tokenizer_config.json")).read())
  config["bos_token"] = None
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  for extra in ("special_tokens_map.json",):
    if os.path.exists(os.path.join(path, extra)):
      os.remove(os.path.join(path, extra))
  tok = make_tokenizer("hf", path)
  assert tok.bos_id == tok.eos_id == 1
  # Only ids in config.json (a model directory without tokenizer_config.json).
  os.remove(os.path.join(path, "tokenizer_config.json"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({"bos_token_id": 0, "eos_token_id": [1, 2]}, f)
  tok = make_tokenizer("hf", path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 0)
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(ValueError, match="no EOS token"):
    make_tokenizer("hf", path)


def test_hf_tokenizer_errors_name_the_file(tmp_path):
  with pytest.raises(ValueError, match="needs model_path"):
    make_tokenizer("hf")
  with pytest.raises(ValueError, match=r"tokenizer\.json' does not exist"):
    make_tokenizer("hf", str(tmp_path))
  bad = tmp_path / "tokenizer.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="is not a readable tokenizer.json"):
    make_tokenizer("hf", str(bad))


def test_hf_tokenizer_through_the_pipeline(tmp_path):
  from lctx.data.pipeline import DataConfig, make_iterator

  path = _bpe_tokenizer_json(tmp_path)
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(4):
    (docs / f"d{i}.txt").write_text(f"doc {i}: " + "alpha beta gamma return. " * (30 + 20 * i))
  config = DataConfig(
    text_glob=str(docs),
    data_dir=str(tmp_path / "cache"),
    tokenizer="hf",
    tokenizer_model_path=path,
    num_packing_bins=4,
    window_shuffle_size=1,
    validation_fraction=0.3,
  )
  batch = next(
    make_iterator(config, batch_size=2, seq_len=128, seed=0, process_index=0, process_count=1)
  )
  tok = make_tokenizer("hf", path)
  assert batch["inputs"].max() < tok.vocab_size
  real = batch["segment_ids"] > 0
  # Which piece lands in row 0 depends on where tmp_path lies: the prepared
  # records' order follows the corpus fingerprint, which hashes absolute paths
  # (row 0 can be a 2-token document tail). So read every row.
  text = "".join(tok.decode(row[keep]) for row, keep in zip(batch["inputs"], real))
  assert "alpha beta gamma" in text
  assert (batch["inputs"][real] == tok.bos_id).sum() >= 1  # documents start with BOS
