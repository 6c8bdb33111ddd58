"""Tokenizers: byte-level (default, no file needed) and SentencePiece.

Both share one interface so the pipeline, evals and inspection code never care
which one is used:

    tok.encode(text: str) -> list[int]   # no BOS/EOS added
    tok.decode(ids) -> str               # special ids skipped, never raises
    tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id

Id 0 is padding for both, because the batch contract uses segment id 0 = pad and
the model may embed pad tokens: keeping pad at 0 makes zero-filled rows valid.
"""

from __future__ import annotations

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

  The model must have been trained with pad=0, bos=1, eos=2 (as
  scripts/train_sentencepiece.py does) so that pad is id 0 everywhere in lctx;
  anything else raises ValueError at load time.
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
    self.pad_id = int(self._sp.pad_id())
    self.bos_id = int(self._sp.bos_id())
    self.eos_id = int(self._sp.eos_id())
    if (self.pad_id, self.bos_id, self.eos_id) != (0, 1, 2):
      raise ValueError(
        "SentencePiece model must use pad_id=0, bos_id=1, eos_id=2 (lctx "
        f"reserves 0 for padding); {model_path} has pad={self.pad_id}, "
        f"bos={self.bos_id}, eos={self.eos_id}."
      )

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size())

  def encode(self, text: str) -> list[int]:
    # SentencePiece wants valid UTF-8; surrogates are the only way a str is not.
    text = text.encode("utf-8", errors="replace").decode("utf-8")
    return list(self._sp.encode(text, out_type=int))

  def encode_array(self, text: str) -> np.ndarray:
    return np.asarray(self.encode(text), dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
    arr = arr.astype(np.int64).reshape(-1)
    keep = (arr > self.eos_id) & (arr < self.vocab_size)
    return self._sp.decode([int(i) for i in arr[keep]])


def make_tokenizer(name: str = "byte", model_path: str | None = None):
  """'byte' -> ByteTokenizer(); 'sentencepiece' -> SentencePieceTokenizer(model_path)."""
  if name == "byte":
    return ByteTokenizer()
  if name in ("sentencepiece", "spm"):
    if not model_path:
      raise ValueError("tokenizer 'sentencepiece' needs model_path=<.model file>.")
    return SentencePieceTokenizer(model_path)
  raise ValueError(f"unknown tokenizer {name!r}; expected 'byte' or 'sentencepiece'.")
