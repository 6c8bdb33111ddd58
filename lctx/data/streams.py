"""One source spec -> a seeded stream of windows (the same on every process).

Corpus sources (text, jsonl, parquet, tfds) are random access: documents are
selected and repeated by length (min_tokens / max_tokens / upsample), shuffled
with a new permutation every epoch, tokenized and cut into windows. Synthetic
sources generate document i from (seed, split, i). Either way the stream is a
pure function of the seed, so every process can build it and resume it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import grain
import numpy as np

from lctx.data import packing as packing_lib
from lctx.data import sources as sources_lib
from lctx.data import synthetic
from lctx.data.specs import SourceSpec, chat_fields

_SYNTHETIC_SIZE = 2**31 - 1  # documents per epoch of an (endless) synthetic source
# Token lengths of whole corpus sources, per (source, tokenizer settings): a
# length filter or upsampling reads every document once per process.
_LENGTHS: dict[tuple, np.ndarray] = {}


def encode_document(raw: bytes, tokenizer, add_bos: bool, add_eos: bool) -> dict[str, np.ndarray]:
  """Raw document bytes -> {'tokens' int32 [L], 'target_mask' float32 [L]}."""
  if hasattr(tokenizer, "encode_bytes"):
    body = tokenizer.encode_bytes(raw)  # exact bytes, even invalid UTF-8
  else:
    body = np.asarray(tokenizer.encode(raw.decode("utf-8", errors="replace")), np.int32)
  parts = ([np.asarray([tokenizer.bos_id], np.int32)] if add_bos else []) + [body]
  if add_eos:
    parts.append(np.asarray([tokenizer.eos_id], np.int32))
  tokens = np.concatenate(parts).astype(np.int32)
  return {"tokens": tokens, "target_mask": np.ones(len(tokens), np.float32)}


def document_source(config, spec: SourceSpec, split: str):
  """The random-access document source of a corpus spec (raw bytes per item),
  or None for the synthetic kinds, which are generated from indices."""
  if spec.kind in ("text", "jsonl", "parquet", "chat"):
    options = {} if spec.kind == "text" else {"kind": spec.kind, "field": spec.field}
    if spec.kind == "chat":
      options["field"] = json.dumps(chat_fields(spec), sort_keys=True)
    if spec.kind != "text":
      options["skip_bad_rows"] = config.skip_bad_rows
    return sources_lib.open_text_corpus(
      spec.path,
      split=split,
      data_dir=config.data_dir,
      validation_fraction=config.validation_fraction,
      **options,
    )
  if spec.kind == "tfds":
    return sources_lib.open_tfds(spec.name, split=split, feature=spec.field, data_dir=spec.data_dir)
  return None


def document_lengths(source, config, tokenizer) -> np.ndarray:
  """Tokens (BOS/EOS included) of every document of `source`, int64 [N]."""
  key = (
    repr(source),
    config.tokenizer,
    config.tokenizer_model_path,
    config.add_bos,
    config.add_eos,
  )
  if key not in _LENGTHS:
    extra = int(config.add_bos) + int(config.add_eos)
    if hasattr(tokenizer, "encode_bytes"):  # one token per byte: no need to encode
      lengths = [len(source[i]) + extra for i in range(len(source))]
    else:
      lengths = [
        len(encode_document(source[i], tokenizer, config.add_bos, config.add_eos)["tokens"])
        for i in range(len(source))
      ]
    _LENGTHS[key] = np.asarray(lengths, np.int64)
  return _LENGTHS[key]


def selected_documents(spec: SourceSpec, lengths: np.ndarray, seed: int) -> np.ndarray:
  """Document indices of one epoch after the length filters and upsampling, in
  document order (each upsampled document repeated), int64 [M]."""
  keep = np.asarray([spec.keeps(int(n)) for n in lengths], bool)
  factors = np.asarray([spec.upsample_factor(int(n)) for n in lengths], np.float64)
  whole = np.floor(factors)
  extra = np.random.default_rng([seed, 0x5EED]).random(len(lengths)) < factors - whole
  copies = np.where(keep, whole + extra, 0).astype(np.int64)
  return np.repeat(np.arange(len(lengths)), copies)


def _corpus_documents(config, spec, source, *, seed, tokenizer) -> grain.MapDataset:
  ds = grain.MapDataset.source(source)
  if spec.min_tokens or spec.max_tokens or spec.upsample:
    order = selected_documents(spec, document_lengths(source, config, tokenizer), seed)
    if not len(order):
      raise ValueError(
        f"source {spec.label!r}: no document of {source!r} passes min_tokens="
        f"{spec.min_tokens}, max_tokens={spec.max_tokens}."
      )
    ds = grain.MapDataset.range(len(order)).map(lambda j: source[int(order[j])])
  # shuffle before repeat: each epoch gets its own permutation (seed + epoch).
  ds = ds.shuffle(seed=seed).repeat(config.num_epochs)
  return ds.map(lambda raw: encode_document(raw, tokenizer, config.add_bos, config.add_eos))


def _chat_documents(config, spec, source, *, seed) -> grain.MapDataset:
  """Conversations, shuffled per epoch, encoded with the model's chat template."""
  from lctx.data import conversations  # pylint: disable=g-import-not-at-top  (jinja2 for chat)

  spec_args = chat_args(config, spec)
  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(config.num_epochs)

  def encode(raw):
    conv = conversations.encode_stored(raw, *spec_args)
    return {"tokens": conv.ids, "target_mask": conv.loss_mask, "turn_starts": conv.turn_starts}

  return ds.map(encode)


def chat_args(config, spec: SourceSpec) -> tuple:
  return (config.tokenizer_model_path, spec.train_on or "assistant", spec.chat_template)


class ChatWindows(grain.experimental.FlatMapTransform):
  """An encoded conversation -> whole-conversation windows: one if it fits a
  row, the pieces of DataConfig.chat_overflow if not (lctx.data.conversations.fit_pieces)."""

  def __init__(self, seq_len: int, overflow: str, source_id: int | None = None):
    self.seq_len, self.overflow = seq_len, overflow
    self.windows = packing_lib.WindowDocument(seq_len, "restart", None, source_id)
    self.max_fan_out = 1 << 20

  def flat_map(self, element):
    from lctx.data import conversations  # pylint: disable=g-import-not-at-top

    conv = conversations.Conversation(
      element["tokens"], element["target_mask"], element["turn_starts"]
    )
    pieces, _ = conversations.fit_pieces(conv, self.seq_len, self.overflow)
    out = []
    for piece in pieces:
      out += self.windows.flat_map({"tokens": piece.ids, "target_mask": piece.loss_mask})
    return out


def chat_overflow_counts(config, seq_len: int, split: str) -> dict[str, int]:
  """{'chat_conversations', 'chat_dropped', 'chat_split'} over one epoch of
  every chat source: conversations longer than a row that chat_overflow drops
  or splits at turns. Encodes every conversation once."""
  from lctx.data import conversations  # pylint: disable=g-import-not-at-top

  counts = {"chat_conversations": 0, "chat_dropped": 0, "chat_split": 0}
  for spec in config.source_specs():
    if spec.kind != "chat":
      continue
    source = document_source(config, spec, split)
    for i in range(len(source)):
      conv = conversations.encode_stored(source[i], *chat_args(config, spec))
      _, outcome = conversations.fit_pieces(conv, seq_len, config.chat_overflow)
      counts["chat_conversations"] += 1
      if outcome != "fit":
        counts[f"chat_{outcome}"] += 1
  return counts


def _synthetic_documents(
  config, spec, make_document: Callable, *, split, seq_len, seed, tokenizer
) -> grain.MapDataset:
  def cap(index: int) -> int:  # the synthetic length curriculum (DataConfig)
    n, start = config.synthetic_ramp_documents, min(config.synthetic_ramp_start, seq_len)
    if n <= 0 or index >= n:
      return seq_len
    return start + (seq_len - start) * index // n

  def make(index: int):
    tokens, mask = make_document(
      index, seed=seed, split=split, max_tokens=cap(index), tokenizer=tokenizer
    )
    doc = {"tokens": np.asarray(tokens, np.int32), "target_mask": np.asarray(mask, np.float32)}
    return doc if spec.keeps(len(doc["tokens"])) else None

  return grain.MapDataset.range(_SYNTHETIC_SIZE).map(make)


def copy_task(config) -> Callable:
  """make_document of the built-in copy task, with the config's key lengths."""

  def make(index, *, seed, split, max_tokens, tokenizer):
    return synthetic.copy_document(
      index,
      seed=seed,
      split=split,
      max_tokens=max_tokens,
      tokenizer=tokenizer,
      min_key_len=config.copy_min_key_len,
      max_key_len=config.copy_max_key_len,
      loss_on=config.copy_loss_on,
    )

  return make


def source_windows(
  config,
  spec: SourceSpec,
  *,
  make_document: Callable | None,
  split: str,
  seq_len: int,
  seed: int,
  tokenizer,
  source_id: int | None = None,
) -> grain.IterDataset:
  """One source as a seeded stream of windows of at most seq_len examples.

  make_document: the synthetic generator for a synthetic spec (None for a
  corpus). source_id: tag windows with their source for reports (see
  packing.WindowDocument)."""
  if spec.kind == "chat":
    from lctx.data import chat  # pylint: disable=g-import-not-at-top

    chat.load_chat_model(config.tokenizer_model_path, spec.chat_template)  # fail early
    source = document_source(config, spec, split)
    ds = _chat_documents(config, spec, source, seed=seed)
  elif make_document is None:
    source = document_source(config, spec, split)
    ds = _corpus_documents(config, spec, source, seed=seed, tokenizer=tokenizer)
  else:
    ds = _synthetic_documents(
      config, spec, make_document, split=split, seq_len=seq_len, seed=seed, tokenizer=tokenizer
    )
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=64)
  )
  if spec.kind == "chat":
    windows = ChatWindows(seq_len, config.chat_overflow, source_id)
  else:
    windows = packing_lib.WindowDocument(
      seq_len, config.continuation_positions, spec.max_windows_per_document, source_id
    )
  ds = grain.experimental.FlatMapIterDataset(it, windows)
  if config.window_shuffle_size > 1:
    # A long document yields many consecutive windows; without this they fill
    # whole batches by themselves. Checkpoint state stays small (grain refills
    # the window from the parent state at restore).
    ds = grain.experimental.WindowShuffleIterDataset(
      ds, window_size=config.window_shuffle_size, seed=seed
    )
  return ds
