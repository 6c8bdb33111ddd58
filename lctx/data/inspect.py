"""Packing report for `main.py --mode=inspect_data`: what the model will see.

Besides the text report, `inspect_data(..., json_path=...)` writes the record
(a contract, `<workdir>/inspect_data.json` in main.py):

    {"fill_ratio": float, "batches": int, "batch_size": int, "seq_len": int,
     "chat_conversations": int, "chat_dropped": int, "chat_split": int,
     "sources": [{"name", "weight", "token_share", "documents", "tokens",
                  "long_document_token_share", "length_histogram"}, ...]}

chat_*: over one epoch of the conversation ('chat') sources, how many there
are and how many are longer than a row and DataConfig.chat_overflow dropped or
split at turns (0 without chat sources).
token_share: the source's share of the non-pad tokens read; documents: how
many documents began in them; long_document_token_share: share of its tokens
that sit in documents longer than one window (seq_len examples);
length_histogram: {"edges": token lengths, "documents": [n per bin],
"tokens": [n per bin]} (bin i holds edges[i] <= length < edges[i + 1]).
"""

from __future__ import annotations

import json

import numpy as np

from lctx.data import pipeline, streams
from lctx.data.tokenizers import make_tokenizer


def _percentiles(values) -> str:
  if len(values) == 0:
    return "n=0"
  v = np.asarray(values)
  p = np.percentile(v, [0, 10, 50, 90, 100]).round().astype(int)
  return f"n={len(v)} mean={v.mean():.0f} min={p[0]} p10={p[1]} p50={p[2]} p90={p[3]} max={p[4]}"


def _segments(segment_ids_row: np.ndarray) -> list[tuple[int, int, int]]:
  """[(segment id, start, end)] of the non-pad segments of one row [S]."""
  out, start = [], 0
  for i in range(1, len(segment_ids_row) + 1):
    if i == len(segment_ids_row) or segment_ids_row[i] != segment_ids_row[start]:
      if segment_ids_row[start] > 0:
        out.append((int(segment_ids_row[start]), start, i))
      start = i
  return out


def document_lengths(
  config: pipeline.DataConfig, *, split: str = "train", max_docs: int = 200
) -> dict[str, list[int]]:
  """Token lengths (with BOS/EOS) of up to max_docs documents per corpus source."""
  tokenizer = make_tokenizer(config.tokenizer, config.tokenizer_model_path)
  out = {}
  for spec in config.source_specs():
    source = streams.document_source(config, spec, split)
    if source is None:
      continue
    idx = np.linspace(0, len(source) - 1, min(max_docs, len(source))).astype(int)
    if spec.kind == "chat":
      from lctx.data import conversations  # pylint: disable=g-import-not-at-top

      args = streams.chat_args(config, spec)
      out[spec.label] = [len(conversations.encode_stored(source[int(i)], *args).ids) for i in idx]
      continue
    out[spec.label] = [
      len(
        streams.encode_document(source[int(i)], tokenizer, config.add_bos, config.add_eos)["tokens"]
      )
      for i in idx
    ]
  return out


FILL_HALF_WIDTH = 0.005  # the 95% interval of the reported fill_ratio: +-0.005
MIN_BATCHES, MAX_BATCHES = 16, 1000


def read_until_stable(
  it,
  *,
  half_width: float = FILL_HALF_WIDTH,
  min_batches: int = MIN_BATCHES,
  max_batches: int = MAX_BATCHES,
) -> tuple[list[dict], float]:
  """Reads batches until the mean fill ratio's 95% interval (1.96 x the standard
  error over batches) is within +-half_width, at least min_batches, at most
  max_batches (a finite dataset may end sooner). Returns (batches, half width)."""
  batches, fills = [], []
  for b in it:
    batches.append(b)
    fills.append(float((b["segment_ids"] > 0).mean()))
    n = len(fills)
    hw = 1.96 * float(np.std(fills, ddof=1)) / np.sqrt(n) if n > 1 else float("inf")
    if (n >= min_batches and hw <= half_width) or n >= max_batches:
      break
  return batches, hw


def inspect_data(
  config: pipeline.DataConfig,
  *,
  num_batches: int | None = None,
  batch_size: int,
  seq_len: int,
  seed: int = 0,
  split: str = "train",
  show_tokens: int = 300,
  json_path: str | None = None,
) -> str:
  """Reads batches and returns a multi-line report, including `fill_ratio: <x>`
  (non-pad tokens / all tokens, with its 95% interval), documents per row, the
  lengths of document pieces in rows and of whole documents, and the decoded
  start of row 0 with '‖[seg s @pos p]' at each segment boundary.

  num_batches: read exactly this many; None reads until fill_ratio is known to
  +-0.005 (95%), see read_until_stable (how many batches that takes on the
  default corpus: docs/benchmarks.md, "Figures moved from code comments").
  json_path: also write the record of the module docstring there.
  """
  tokenizer = make_tokenizer(config.tokenizer, config.tokenizer_model_path)
  it = pipeline.make_iterator(
    config,
    split=split,
    batch_size=batch_size,
    seq_len=seq_len,
    seed=seed,
    process_index=0,
    process_count=1,
    with_sources=True,
  )
  if num_batches is None:
    batches, half_width = read_until_stable(it)
  else:
    batches = [next(it) for _ in range(num_batches)]
    fills = [float((b["segment_ids"] > 0).mean()) for b in batches]
    half_width = (
      1.96 * float(np.std(fills, ddof=1)) / np.sqrt(len(fills)) if len(fills) > 1 else float("nan")
    )
  num_batches = len(batches)
  seg = np.concatenate([b["segment_ids"] for b in batches])  # [rows, S]
  pos = np.concatenate([b["positions"] for b in batches])
  mask = np.concatenate([b["loss_mask"] for b in batches])
  rows = [_segments(r) for r in seg]
  pieces = [end - start for r in rows for _, start, end in r]
  continued = sum(1 for i, r in enumerate(rows) for _, s, _ in r if pos[i, s] > 0)
  lines = [
    f"sources: {', '.join(s.label for s in config.source_specs())}  packing: {config.packing}  "
    f"tokenizer: {config.tokenizer} (vocab {tokenizer.vocab_size})  "
    f"positions: {config.continuation_positions}",
    f"batches: {num_batches} x [{batch_size}, {seq_len}] = {seg.size} tokens",
    f"fill_ratio: {float((seg > 0).mean()):.4f} (+-{half_width:.4f}, 95% over batches)",
    f"loss_mask_ratio: {float(mask.mean()):.4f}",
    f"documents_per_row: {_percentiles([len(r) for r in rows])}",
    f"pieces_in_rows_length: {_percentiles(pieces)}",
    f"continuation_pieces (first position > 0): {continued} of {len(pieces)}",
  ]
  for kind, lengths in document_lengths(config, split=split).items():
    lines.append(f"document_length[{kind}] (tokens, sample): {_percentiles(lengths)}")
  record = source_record(config, batches, seq_len)
  lines += source_table(record)
  chats = streams.chat_overflow_counts(config, seq_len, split)
  if chats["chat_conversations"]:
    lines.append(
      f"conversations: {chats['chat_conversations']} per epoch; longer than a row: "
      f"{chats['chat_dropped']} dropped, {chats['chat_split']} split at turns "
      f"(chat_overflow={config.chat_overflow!r})"
    )
  inputs = batches[0]["inputs"][0]
  lines.append(f"row 0 start ({show_tokens} tokens; ‖[seg s @pos p] marks a segment start):")
  text = []
  for s, start, end in rows[0]:
    if start >= show_tokens:
      break
    text.append(f"‖[seg {s} @pos {int(pos[0, start])}]")
    text.append(tokenizer.decode(inputs[start : min(end, show_tokens)]))
  lines.append("".join(text))
  if json_path is not None:
    record = dict(
      fill_ratio=float((seg > 0).mean()),
      batches=num_batches,
      batch_size=batch_size,
      seq_len=seq_len,
      **chats,
      **record,
    )
    with open(json_path, "w") as f:
      json.dump(record, f, indent=2)
    lines.append(f"wrote {json_path}")
  return "\n".join(lines)


HISTOGRAM_EDGES = (0, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)


def source_record(config, batches: list[dict], seq_len: int) -> dict:
  """{'sources': [...]} of the module docstring, from batches read with_sources."""
  src = np.concatenate([b["source_ids"] for b in batches]).ravel()
  lengths = np.concatenate([b["document_lengths"] for b in batches]).ravel()
  starts = np.concatenate([b["document_starts"] for b in batches]).ravel() > 0
  specs = config.source_specs()
  total_weight = sum(spec.weight for spec in specs)
  real = max(int((src > 0).sum()), 1)
  edges = np.asarray(HISTOGRAM_EDGES + (np.iinfo(np.int64).max,))
  out = []
  for i, spec in enumerate(specs):
    mine = src == i + 1
    tokens = int(mine.sum())
    doc_lengths = lengths[mine & starts]
    out.append(
      dict(
        name=spec.label,
        weight=spec.weight / total_weight,
        token_share=tokens / real,
        documents=int(len(doc_lengths)),
        tokens=tokens,
        # More than seq_len next-token examples = cut into several windows.
        long_document_token_share=float((lengths[mine] - 1 > seq_len).sum() / max(tokens, 1)),
        length_histogram=dict(
          edges=list(HISTOGRAM_EDGES),
          documents=np.histogram(doc_lengths, edges)[0].tolist(),
          tokens=np.histogram(lengths[mine], edges)[0].tolist(),
        ),
      )
    )
  return {"sources": out}


def source_table(record: dict) -> list[str]:
  """The record's sources as table lines."""
  lines = [
    f"{'source':<24} {'weight':>7} {'token_share':>11} {'documents':>9} {'tokens':>10} "
    f"{'in_long_docs':>12}"
  ]
  for r in record["sources"]:
    lines.append(
      f"{r['name'][:24]:<24} {r['weight']:>7.3f} {r['token_share']:>11.4f} {r['documents']:>9} "
      f"{r['tokens']:>10} {r['long_document_token_share']:>12.3f}"
    )
  return lines
