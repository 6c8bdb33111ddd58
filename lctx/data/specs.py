"""Source specs: what one entry of `DataConfig.sources` means.

An entry is a name (today's 'text', 'tfds', 'copy' or a registered task; they
read the DataConfig fields text_glob / tfds_*) or a dict:

    {'kind': 'jsonl', 'path': '/data/arxiv/*.jsonl.gz', 'field': 'text',
     'weight': 0.3,                      # share of TOKENS in the mix
     'min_tokens': 64, 'max_tokens': None,   # drop documents outside [min, max]
     'upsample': ((8192, 2.0), (65536, 4.0)),  # ProLong-style, see below
     'max_windows_per_document': 16,     # at most this many windows per copy
     'name': 'arxiv'}                    # label in reports (default: from path)

kind: 'text' (a glob or directory of files), 'jsonl' (.jsonl / .jsonl.gz),
'parquet', 'tfds' (a prepared catalogue dataset: name, field, data_dir), or a
synthetic task ('copy', registered tasks). Lengths count tokens of the
pipeline's tokenizer, BOS/EOS included.

A conversation source (kind 'chat', .jsonl / .jsonl.gz / .parquet files; see
docs/sft.md) reads rows of messages or of prompt / completion pairs, renders
them with the model's chat template (lctx/data/chat.py) and trains on the
assistant turns:

    {'kind': 'chat', 'path': '/data/sft/*.jsonl', 'field': 'messages', 'weight': 0.5}
    {'kind': 'chat', 'path': '/data/qa.parquet', 'prompt_field': 'question',
     'completion_field': 'answer', 'system_field': 'system'}

system_field (default 'system'): a row's system prompt, prepended as a system
turn when the row has it. train_on: 'assistant' (default) or 'all'.
chat_template: instead of the model's template, another model directory's
(e.g. the instruct model's, for a base checkpoint), a .jinja file or the text.
Length filters and upsampling do not apply to conversations;
DataConfig.chat_overflow says what happens to one longer than a row.

upsample: pairs (length, factor); a document of L tokens appears factor times
per epoch, the factor of the largest length <= L (1 below the first). A
fractional factor is met on average: each document draws its extra copy from a
seeded rng, the same draw every epoch.
"""

from __future__ import annotations

import dataclasses
import os

FILE_KINDS = ("text", "jsonl", "parquet", "chat")
CORPUS_KINDS = FILE_KINDS + ("tfds",)
CHAT_KEYS = ("prompt_field", "completion_field", "system_field", "train_on", "chat_template")
SPEC_KEYS = (
  "kind",
  "name",
  "path",
  "field",
  "data_dir",
  "weight",
  "min_tokens",
  "max_tokens",
  "upsample",
  "max_windows_per_document",
) + CHAT_KEYS


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """One source of the mixture (see the module docstring for each field)."""

  kind: str
  name: str | None = None
  """Display name; for kind 'tfds' the catalogue dataset's name."""
  path: str | None = None
  field: str | None = None
  data_dir: str | None = None
  weight: float = 1.0
  min_tokens: int | None = None
  max_tokens: int | None = None
  upsample: tuple[tuple[int, float], ...] = ()
  max_windows_per_document: int | None = None
  prompt_field: str | None = None
  completion_field: str | None = None
  system_field: str | None = None
  train_on: str | None = None
  chat_template: str | None = None

  @property
  def label(self) -> str:
    """The name reports and errors use."""
    if self.name:
      return self.name
    if self.path:
      base = os.path.basename(self.path.rstrip("/")) or self.path
      return f"{self.kind}:{base}"
    return self.kind

  @property
  def is_corpus(self) -> bool:
    return self.kind in CORPUS_KINDS

  def upsample_factor(self, length: int) -> float:
    factor = 1.0
    for threshold, f in self.upsample:
      if length >= threshold:
        factor = f
    return factor

  def keeps(self, length: int) -> bool:
    """Whether a document of `length` tokens passes the length filters."""
    if self.min_tokens is not None and length < self.min_tokens:
      return False
    return self.max_tokens is None or length <= self.max_tokens


def parse_spec(entry, synthetic_kinds: tuple[str, ...], weight: float | None) -> SourceSpec:
  """A DataConfig.sources entry (dict or SourceSpec) -> a validated SourceSpec.

  weight: the DataConfig.weights entry for it, if weights are given there.
  """
  if isinstance(entry, SourceSpec):
    raw = dataclasses.asdict(entry)
  elif isinstance(entry, dict):
    raw = dict(entry)
  else:
    raise ValueError(
      f"DataConfig.sources entry {entry!r} must be a source name or a dict with keys {SPEC_KEYS}."
    )
  unknown = sorted(set(raw) - set(SPEC_KEYS))
  if unknown:
    raise ValueError(
      f"DataConfig.sources entry {entry!r}: unknown keys {unknown}; use {SPEC_KEYS}."
    )
  kind = raw.get("kind")
  if kind not in CORPUS_KINDS and kind not in synthetic_kinds:
    raise ValueError(
      f"DataConfig.sources entry {entry!r}: kind {kind!r} is not one of "
      f"{CORPUS_KINDS + synthetic_kinds}."
    )
  if weight is not None:
    if raw.get("weight") is not None and isinstance(entry, dict):
      raise ValueError(
        f"DataConfig.sources entry {entry!r} has a weight and DataConfig.weights is set too; "
        "give weights in one place."
      )
    raw["weight"] = weight
  raw["weight"] = float(raw.get("weight", 1.0) if raw.get("weight") is not None else 1.0)
  raw["upsample"] = tuple((int(t), float(f)) for t, f in (raw.get("upsample") or ()))
  spec = SourceSpec(**raw)
  where = f"DataConfig.sources entry {spec.label!r}"
  if kind in FILE_KINDS and not spec.path:
    raise ValueError(f"{where}: kind {kind!r} needs 'path' (a file, directory or glob).")
  if kind in ("jsonl", "parquet") and not spec.field:
    raise ValueError(f"{where}: kind {kind!r} needs 'field' (the column holding the text).")
  if kind == "chat":
    _check_chat(spec, where)
  elif any(getattr(spec, key) is not None for key in CHAT_KEYS):
    keys = [key for key in CHAT_KEYS if getattr(spec, key) is not None]
    raise ValueError(f"{where}: {keys} apply only to kind 'chat'.")
  if kind == "tfds" and not (spec.name and spec.field):
    raise ValueError(f"{where}: kind 'tfds' needs 'name' (catalogue dataset) and 'field'.")
  if spec.weight < 0:
    raise ValueError(f"{where}: weight must be >= 0, got {spec.weight}.")
  for key in ("min_tokens", "max_tokens", "max_windows_per_document"):
    value = getattr(spec, key)
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"{where}: {key} must be a positive int or None, got {value!r}.")
  if spec.min_tokens and spec.max_tokens and spec.min_tokens > spec.max_tokens:
    raise ValueError(f"{where}: min_tokens {spec.min_tokens} > max_tokens {spec.max_tokens}.")
  lengths = [t for t, _ in spec.upsample]
  if lengths != sorted(set(lengths)) or any(f < 0 for _, f in spec.upsample):
    raise ValueError(
      f"{where}: upsample must be (length, factor) pairs with increasing lengths and "
      f"factors >= 0, got {spec.upsample}."
    )
  if spec.upsample and not spec.is_corpus:
    raise ValueError(f"{where}: upsample needs a corpus source, not the synthetic {kind!r}.")
  return spec


def _check_chat(spec: SourceSpec, where: str) -> None:
  pair = (spec.prompt_field, spec.completion_field)
  if bool(spec.field) == all(pair) or (any(pair) and not all(pair)):
    raise ValueError(
      f"{where}: kind 'chat' needs either 'field' (the column of messages) or both "
      f"'prompt_field' and 'completion_field', got field={spec.field!r}, "
      f"prompt_field={spec.prompt_field!r}, completion_field={spec.completion_field!r}."
    )
  if spec.train_on not in (None, "assistant", "all"):
    raise ValueError(f"{where}: train_on must be 'assistant' or 'all', got {spec.train_on!r}.")
  filters = ("min_tokens", "max_tokens", "max_windows_per_document")
  used = [k for k in filters if getattr(spec, k) is not None] + (
    ["upsample"] if spec.upsample else []
  )
  if used:
    raise ValueError(
      f"{where}: {used} do not apply to conversations (DataConfig.chat_overflow handles long ones)."
    )


def chat_fields(spec: SourceSpec) -> dict:
  """The row fields of a chat spec: {'messages' | 'prompt', 'completion', 'system'}."""
  return {
    "messages": spec.field if not spec.prompt_field else None,
    "prompt": spec.prompt_field,
    "completion": spec.completion_field,
    "system": spec.system_field or "system",
  }
