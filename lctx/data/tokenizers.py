"""Tokenizers: byte-level (default, no file needed), SentencePiece, and Hugging Face
`tokenizer.json` (the `tokenizers` library: Llama 3, Qwen, Mistral).

All share one interface so the pipeline, evals and inspection code never care
which one is used:

    tok.encode(text: str) -> list[int]   # no BOS/EOS added
    tok.decode(ids) -> str               # special ids skipped, never raises
    tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id

Padding is marked by segment id 0 (docs/contracts.md), never by a token id: the
pipeline and evals fill pad cells with id 0, which every vocabulary has, and the
attention mask and loss mask ignore them. So a tokenizer's own pad id only has to
be a valid id, and one without a pad token (Llama 2 and Mistral SentencePiece
models, pad = -1) reports pad_id 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
  """What every tokenizer in lctx provides."""

  pad_id: int
  bos_id: int
  eos_id: int

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted by 3: pad=0, bos=1, eos=2, byte b -> id b + 3.

  vocab_size = 259. Any string encodes (Python str is always valid Unicode;
  lone surrogates are written with 'surrogatepass' so they round-trip as bytes);
  any id sequence decodes: special ids are skipped, ids outside [3, 259) are
  skipped too, and invalid UTF-8 is replaced with U+FFFD.
  """

  pad_id: int = 0
  bos_id: int = 1
  eos_id: int = 2
  offset: int = 3

  @property
  def vocab_size(self) -> int:
    return 256 + self.offset

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def encode_array(self, text: str) -> np.ndarray:
    """Fast path for the pipeline: int32 [len(utf8 bytes)]."""
    data = text.encode("utf-8", errors="surrogatepass")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + self.offset

  def encode_bytes(self, data: bytes) -> np.ndarray:
    """Raw bytes (possibly invalid UTF-8) -> int32 ids; never fails."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + self.offset

  def decode(self, ids: Iterable[int]) -> str:
    arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
    arr = arr.astype(np.int64).reshape(-1)
    arr = arr[(arr >= self.offset) & (arr < self.vocab_size)] - self.offset
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A trained SentencePiece `.model` with the ByteTokenizer interface.

  Any id layout loads (lctx's own from scripts/train_sentencepiece.py: pad 0,
  bos 1, eos 2; Llama 2 / Mistral: unk 0, bos 1, eos 2, no pad) as long as the
  model defines BOS and EOS, which the pipeline writes around documents.
  """

  def __init__(self, model_path: str):
    import sentencepiece as spm  # imported here: byte-level runs never load it

    model_path = os.path.expanduser(model_path)
    if not os.path.exists(model_path):
      raise ValueError(
        f"SentencePiece model {model_path!r} does not exist; train one with "
        "`python scripts/train_sentencepiece.py --output_prefix=...`."
      )
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    self.bos_id = int(self._sp.bos_id())
    self.eos_id = int(self._sp.eos_id())
    if self.bos_id < 0 or self.eos_id < 0:
      raise ValueError(
        f"SentencePiece model {model_path} has bos={self.bos_id}, eos={self.eos_id}: "
        "lctx needs both (documents are written as BOS ... EOS); train it with "
        "bos_id >= 0 and eos_id >= 0."
      )
    pad = int(self._sp.pad_id())
    self.pad_id = pad if pad >= 0 else 0  # pad cells are marked by segment id 0
    # Control pieces (BOS, EOS, a pad piece) are what decode leaves out.
    self._control = np.asarray([self._sp.is_control(i) for i in range(self.vocab_size)], dtype=bool)

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size())

  def encode(self, text: str) -> list[int]:
    # SentencePiece wants valid UTF-8; surrogates are the only way a str is not.
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    return list(self._sp.encode(text, out_type=int))

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """encode's ids and each token's (start, end) characters in `text`."""
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    out = self._tok.encode(text, add_special_tokens=False)
    return list(out.ids), [tuple(o) for o in out.offsets]

  def decode(self, ids: Iterable[int]) -> str:
    arr = _in_range(ids, self.vocab_size)
    return self._sp.decode([int(i) for i in arr[~self._control[arr]]])


class HFTokenizer:
  """A Hugging Face `tokenizer.json` through the `tokenizers` library.

  model_path: the tokenizer.json file or the directory holding it. encode gives
  exactly `tokenizers`' ids with no special tokens added (its post-processor's
  BOS is not applied: the pipeline adds BOS/EOS itself; a special token's text
  inside a document still becomes that token, as in `tokenizers`); decode skips
  special tokens. BOS/EOS/pad come from the files beside it, first found wins:
  tokenizer_config.json and special_tokens_map.json (`bos_token`, `eos_token`,
  `pad_token`, as strings or {"content": ...}), then config.json and
  generation_config.json (`bos_token_id`, `eos_token_id` (first of a list),
  `pad_token_id`). With no BOS (Qwen) documents start with EOS, the one
  separator such models were trained with; no EOS is a ValueError.
  """

  SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")
  ID_FILES = ("config.json", "generation_config.json")

  def __init__(self, model_path: str):
    import tokenizers  # imported here: byte-level runs never load it

    path = os.path.expanduser(model_path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise ValueError(
        f"tokenizer 'hf': {file!r} does not exist; model_path must be a tokenizer.json "
        "file or the directory holding it."
      )
    self.model_path = file
    try:
      self._tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the library raises its own exception type
      raise ValueError(f"tokenizer 'hf': {file} is not a readable tokenizer.json: {e}") from e
    directory = os.path.dirname(os.path.abspath(file))
    eos = self._special_id(directory, "eos")
    if eos is None:
      raise ValueError(
        f"tokenizer 'hf': no EOS token for {file}: none of {self.SPECIAL_FILES} names "
        f"an eos_token and none of {self.ID_FILES} gives an eos_token_id."
      )
    bos = self._special_id(directory, "bos")
    pad = self._special_id(directory, "pad")
    self.eos_id = eos
    self.bos_id = eos if bos is None else bos
    self.pad_id = 0 if pad is None else pad  # pad cells are marked by segment id 0

  def _special_id(self, directory: str, kind: str) -> int | None:
    for name in self.SPECIAL_FILES:
      token = _read_json(os.path.join(directory, name)).get(f"{kind}_token")
      if isinstance(token, dict):
        token = token.get("content")
      if isinstance(token, str):
        found = self._tok.token_to_id(token)
        if found is None:
          raise ValueError(
            f"tokenizer 'hf': {name} names {kind}_token {token!r}, which "
            f"{self.model_path} does not have."
          )
        return int(found)
    for name in self.ID_FILES:
      value = _read_json(os.path.join(directory, name)).get(f"{kind}_token_id")
      if isinstance(value, list):
        value = value[0] if value else None
      if isinstance(value, int) and 0 <= value < self.vocab_size:
        return value
    return None

  @property
  def vocab_size(self) -> int:
    return int(self._tok.get_vocab_size(with_added_tokens=True))

  def encode(self, text: str) -> list[int]:
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """encode's ids and each token's (start, end) characters in `text`."""
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    out = self._tok.encode(text, add_special_tokens=False)
    return list(out.ids), [tuple(o) for o in out.offsets]

  def decode(self, ids: Iterable[int]) -> str:
    arr = _in_range(ids, self.vocab_size)
    return self._tok.decode([int(i) for i in arr], skip_special_tokens=True)


def _in_range(ids: Iterable[int], vocab_size: int) -> np.ndarray:
  """int64 [n] of the ids in [0, vocab_size) (decode never raises on others)."""
  arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
  arr = arr.astype(np.int64).reshape(-1)
  return arr[(arr >= 0) & (arr < vocab_size)]


def _read_json(file: str) -> dict:
  if not os.path.isfile(file):
    return {}
  with open(file) as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"tokenizer 'hf': {file} is not valid JSON: {e}") from e
  return data if isinstance(data, dict) else {}


TOKENIZERS = ("byte", "sentencepiece", "hf")


def make_tokenizer(name: str = "byte", model_path: str | None = None):
  """'byte' -> ByteTokenizer(); 'sentencepiece' -> SentencePieceTokenizer(model_path);
  'hf' -> HFTokenizer(model_path) (a tokenizer.json or its directory)."""
  if name == "byte":
    return ByteTokenizer()
  if name in ("sentencepiece", "spm"):
    if not model_path:
      raise ValueError("tokenizer 'sentencepiece' needs model_path=<.model file>.")
    return SentencePieceTokenizer(model_path)
  if name == "hf":
    if not model_path:
      raise ValueError("tokenizer 'hf' needs model_path=<tokenizer.json or its directory>.")
    return HFTokenizer(model_path)
  raise ValueError(f"unknown tokenizer {name!r}; expected one of {TOKENIZERS}.")
