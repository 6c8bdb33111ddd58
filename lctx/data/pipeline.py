"""The grain pipeline: sources -> select/upsample by length -> shuffle ->
tokenize -> windows -> mixture by tokens -> packing -> batch contract -> global
batches -> this process's rows -> batch_transform.

    it = make_iterator(DataConfig(), split="train", batch_size=8, seq_len=1024, seed=0)
    batch = next(it)            # dict of numpy [8, 1024], see docs/contracts.md
    state = it.get_state()      # JSON-serialisable; store it in the checkpoint
    it.set_state(state)         # resumes exactly: the same batches follow

Every random choice derives from `seed` and element indices (grain's index
shuffles, per-document rngs), never from wall-clock or thread timing, so two
runs with one seed give identical batches and a restored state continues the
uninterrupted stream. Every process builds the same global stream and keeps its
block of rows, so the global batch, and the state, do not depend on the number
of processes (a checkpoint resumes on another process count).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grain
import numpy as np

from lctx.data import mixing, streams, synthetic
from lctx.data import packing as packing_lib
from lctx.data.specs import SourceSpec, parse_spec
from lctx.data.tokenizers import make_tokenizer

SOURCE_KINDS = ("text", "tfds", "copy")  # the names DataConfig.sources accepts as strings
# Synthetic task sources registered from outside lctx.data (e.g. the retrieval
# tasks of lctx.evals), so data never imports the packages above it.
_TASK_SOURCES: dict[str, Callable[..., tuple[np.ndarray, np.ndarray]]] = {}


def register_task_source(
  name: str, make_document: Callable[..., tuple[np.ndarray, np.ndarray]]
) -> None:
  """Registers a synthetic source usable in `DataConfig.sources`.

  make_document(index, *, seed, split, max_tokens, tokenizer) returns
  (tokens int32 [L], target_mask float32 [L]) with L <= max_tokens + 1, the same
  layout as the copy task: a pure function of its arguments, so the source is
  random access, deterministic and shards by index.
  """
  if name in SOURCE_KINDS or name in ("jsonl", "parquet"):
    raise ValueError(f"task source name {name!r} collides with a built-in source.")
  _TASK_SOURCES[name] = make_document


def task_source_names() -> tuple[str, ...]:
  return tuple(_TASK_SOURCES)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to pack it. Each field is a plain gin-bindable value."""

  sources: tuple = ("text",)
  """Sources mixed into the stream. A name: 'text' (local corpus builder over
  text_glob), 'tfds' (catalogue dataset tfds_name/tfds_feature), 'copy'
  (synthetic copy task; needs no corpus) or a registered task. Or a dict
  {kind, path | name, field, weight, min_tokens, max_tokens, upsample,
  max_windows_per_document} (lctx/data/specs.py); kind 'chat' reads
  conversations (prompt_field, completion_field, system_field, train_on,
  chat_template; see docs/sft.md): several files of one kind,
  length filters and ProLong-style upsampling of long documents."""
  weights: tuple[float, ...] = ()
  """Share of TOKENS per source (normalised); () = each dict's 'weight', else
  equal. The mixture keeps each share within one window of its weight."""
  text_glob: str = "stdlib"
  """Directory or glob of text files for 'text'; 'stdlib' = the embedded corpus."""
  data_dir: str | None = None
  """Cache of the prepared local corpus; None = $LCTX_DATA_DIR or ~/.cache/lctx/tfds."""
  validation_fraction: float = 0.02
  """Share of local documents (by key hash) in the 'validation' split."""
  tfds_name: str = "pg19"
  tfds_feature: str = "book_text"
  tfds_data_dir: str | None = None
  """Where the prepared (array_record) catalogue dataset lives, e.g. a gs:// bucket."""
  tokenizer: str = "byte"
  """'byte' (vocab 259), 'sentencepiece' (a .model file) or 'hf' (a tokenizer.json or
  its directory); the last two need tokenizer_model_path."""
  tokenizer_model_path: str | None = None
  packing: str = "first_fit"
  """'first_fit': whole windows into rows, pad at row ends; 'concat_split':
  no padding, documents cut at row boundaries."""
  num_packing_bins: int | None = None
  """first_fit rows filled at once; more bins = fewer pads, more host memory
  (bins x seq_len x 16 B). grain emits all bins as soon as one window fits in
  none, so full-length windows of long documents need many bins to keep pads
  rare. None = min(256, max(8, 2**22 // seq_len)), i.e. ~4M tokens buffered
  (the first batch and a resume replay read that much): 256 bins up to 16K
  (fill 0.99 on the default corpus at 1024/4096), 128 at 32K (0.984), 8 from
  512K up, where concat_split is the better choice for fill."""
  continuation_positions: str = "absolute"
  """Windows after the first of a long document: 'absolute' keeps the true
  positions (k*seq_len + i); 'restart' starts them at 0."""
  add_bos: bool = True
  add_eos: bool = True
  num_epochs: int | None = None
  """None = repeat forever (training); 1 = one pass (evaluation)."""
  copy_min_key_len: int = 8
  copy_max_key_len: int = 32
  copy_loss_on: str = "copy"
  """'copy': loss only on the copied key (+ newline, EOS); 'all': every target."""
  window_shuffle_size: int = 256
  """Windows shuffled together after cutting documents, so that one long
  document does not fill whole batches; host memory ~ size x seq_len x 16 B."""
  skip_bad_rows: bool = False
  """jsonl/parquet rows that are not JSON, lack the field or sit past a
  truncation: False = a ValueError naming the file and line; True = skipped,
  counted into metrics.jsonl (data/skipped_rows, and the first one named)."""
  read_threads: int = 2
  """grain threads reading and tokenizing documents (the cores are few)."""
  synthetic_ramp_documents: int = 0
  """Length curriculum for the synthetic sources ('copy' and registered tasks):
  document i of each source is at most synthetic_ramp_start + (seq_len -
  synthetic_ramp_start) * i / synthetic_ramp_documents tokens, so training
  starts on short documents (dense answers, short distances) and reaches full
  rows after that many documents. A pure function of the index: deterministic
  and resumable. 0 = off (every document may be a full row)."""
  synthetic_ramp_start: int = 256
  """Length cap of the first synthetic documents (see synthetic_ramp_documents)."""
  chat_overflow: str = "drop"
  """A conversation ('chat' source) longer than a row (seq_len + 1 tokens):
  'drop' it, or 'split_turns': cut it at message starts into pieces that each
  fit a row (each its own segment, positions from 0; a piece with no
  supervised token is left out; a single message longer than a row drops the
  conversation). Counted in inspect_data.json as chat_dropped / chat_split.
  Packing never cuts a conversation otherwise."""

  def __post_init__(self):
    if not self.sources:
      raise ValueError("DataConfig.sources is empty; use e.g. ('text',) or ('copy',).")
    if self.weights and len(self.weights) != len(self.sources):
      raise ValueError(
        f"DataConfig.weights has {len(self.weights)} entries for "
        f"{len(self.sources)} sources {self.sources}."
      )
    if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
      raise ValueError(f"DataConfig.weights must be >= 0 with a positive sum: {self.weights}.")
    # Dicts become SourceSpecs (hashable, validated); names stay names.
    object.__setattr__(
      self,
      "sources",
      tuple(
        s if isinstance(s, str) else parse_spec(s, _synthetic_kinds(), self._weight(i))
        for i, s in enumerate(self.sources)
      ),
    )
    for s in self.sources:
      if isinstance(s, str) and s not in SOURCE_KINDS and s not in _TASK_SOURCES:
        raise ValueError(
          f"unknown data source {s!r}; expected one of {SOURCE_KINDS + task_source_names()} "
          "or a dict (lctx/data/specs.py)."
        )
    labels = [spec.label for spec in self.source_specs()]
    if len(set(labels)) != len(labels):
      raise ValueError(
        f"DataConfig.sources has duplicates: {labels}; give same-kind sources a 'name'."
      )
    if sum(spec.weight for spec in self.source_specs()) <= 0:
      raise ValueError(f"DataConfig.sources weights must have a positive sum: {labels}.")
    self._check_chat()
    if self.packing not in ("first_fit", "concat_split"):
      raise ValueError(f"packing must be 'first_fit' or 'concat_split', got {self.packing!r}.")
    if self.continuation_positions not in ("absolute", "restart"):
      raise ValueError(
        "continuation_positions must be 'absolute' or 'restart', "
        f"got {self.continuation_positions!r}."
      )
    if self.copy_loss_on not in ("copy", "all"):
      raise ValueError(f"copy_loss_on must be 'copy' or 'all', got {self.copy_loss_on!r}.")
    if self.synthetic_ramp_documents < 0 or self.synthetic_ramp_start < 1:
      raise ValueError(
        "synthetic_ramp_documents must be >= 0 and synthetic_ramp_start "
        f">= 1, got {self.synthetic_ramp_documents} and "
        f"{self.synthetic_ramp_start}."
      )

  def _check_chat(self):
    if self.chat_overflow not in ("drop", "split_turns"):
      raise ValueError(
        f"DataConfig.chat_overflow must be 'drop' or 'split_turns', got {self.chat_overflow!r}."
      )
    chats = [spec.label for spec in self.source_specs() if spec.kind == "chat"]
    if not chats:
      return
    if self.tokenizer != "hf" or not self.tokenizer_model_path:
      raise ValueError(
        f"chat sources {chats} need tokenizer='hf' and tokenizer_model_path (the directory "
        "with tokenizer.json and the chat template); got tokenizer="
        f"{self.tokenizer!r}, tokenizer_model_path={self.tokenizer_model_path!r}."
      )
    if self.packing != "first_fit":
      raise ValueError(
        f"chat sources {chats} need packing='first_fit': 'concat_split' cuts documents at "
        "row ends, and a conversation is never cut (see chat_overflow)."
      )

  def _weight(self, index: int) -> float | None:
    return float(self.weights[index]) if self.weights else None

  def source_specs(self) -> tuple[SourceSpec, ...]:
    """Every source as a SourceSpec; names read the text_glob / tfds_* fields."""
    out = []
    for i, s in enumerate(self.sources):
      if isinstance(s, SourceSpec):
        out.append(s)
        continue
      w = self._weight(i)
      w = 1.0 if w is None else w
      if s == "text":
        out.append(SourceSpec(kind="text", name="text", path=self.text_glob, weight=w))
      elif s == "tfds":
        out.append(
          SourceSpec(
            kind="tfds",
            name=self.tfds_name,
            field=self.tfds_feature,
            data_dir=self.tfds_data_dir,
            weight=w,
          )
        )
      else:
        out.append(SourceSpec(kind=s, weight=w))
    return tuple(out)


def _synthetic_kinds() -> tuple[str, ...]:
  return ("copy",) + task_source_names()


def synthetic_generator(config: DataConfig, spec: SourceSpec) -> Callable | None:
  """make_document of a synthetic spec; None for a corpus spec."""
  if spec.kind == "copy":
    return streams.copy_task(config)
  return _TASK_SOURCES.get(spec.kind)


def packing_bins(config: DataConfig, seq_len: int) -> int:
  if config.num_packing_bins is not None:
    return config.num_packing_bins
  return min(256, max(8, 2**22 // seq_len))


def _pack(
  ds: grain.IterDataset, config: DataConfig, seq_len: int, seed: int, with_sources: bool
) -> grain.IterDataset:
  features = packing_lib.PACKED_FEATURES + (packing_lib.SOURCE_FEATURES if with_sources else ())
  lengths = {k: seq_len for k in features}
  if config.packing == "first_fit":
    return grain.experimental.FirstFitPackIterDataset(
      ds,
      length_struct=lengths,
      num_packing_bins=packing_bins(config, seq_len),
      seed=seed,
      shuffle_bins=True,
      # Carried along without segment ids/positions of their own.
      meta_features=tuple(k for k in features if k not in ("inputs", "targets")),
    )
  return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)


def _check_copy_lengths(config: DataConfig, seq_len: int) -> None:
  if not any(spec.kind == "copy" for spec in config.source_specs()):
    return
  min_copy = synthetic.min_copy_seq_len(config.copy_max_key_len)
  if seq_len < min_copy:
    raise ValueError(
      f"the copy task needs seq_len >= {min_copy} for copy_max_key_len="
      f"{config.copy_max_key_len}; got seq_len={seq_len} "
      "(lower copy_max_key_len or raise seq_len)."
    )
  if config.synthetic_ramp_documents and config.synthetic_ramp_start < min_copy:
    raise ValueError(
      f"the copy task needs synthetic_ramp_start >= {min_copy} for copy_max_key_len="
      f"{config.copy_max_key_len}; got {config.synthetic_ramp_start}."
    )


def make_dataset(
  config: DataConfig,
  *,
  split: str = "train",
  batch_size: int,
  seq_len: int,
  seed: int,
  process_index: int | None = None,
  process_count: int | None = None,
  batch_transform: Callable[[dict], dict] | None = None,
  with_sources: bool = False,
) -> grain.IterDataset:
  """The grain IterDataset behind make_iterator (same arguments).

  with_sources: batches also carry `source_ids` (1 + the source's index in
  config.sources, 0 = pad), `document_lengths` (tokens of each token's whole
  document) and `document_starts` (1 on a document's first token), int32
  [batch, seq], for reports; not part of the batch contract.
  """
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top  (only when not given)

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(
      f"process_index={process_index} must be in [0, process_count={process_count})."
    )
  if batch_size <= 0 or seq_len <= 0:
    raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must be positive.")
  _check_copy_lengths(config, seq_len)
  tokenizer = make_tokenizer(config.tokenizer, config.tokenizer_model_path)
  specs = config.source_specs()
  streams_ = [
    streams.source_windows(
      config,
      spec,
      make_document=synthetic_generator(config, spec),
      split=split,
      seq_len=seq_len,
      # Each source gets its own seed so adding one does not reshuffle others.
      seed=(seed * 1_000_003 + i) % 2**32,
      tokenizer=tokenizer,
      source_id=i + 1 if with_sources else None,
    )
    for i, spec in enumerate(specs)
  ]
  if len(streams_) == 1:
    ds = streams_[0]
  else:
    ds = mixing.TokenMixIterDataset(streams_, [spec.weight for spec in specs])
  ds = _pack(ds, config, seq_len, seed, with_sources)
  absolute = config.continuation_positions == "absolute"
  ds = ds.map(lambda row: packing_lib.to_batch_contract(row, absolute=absolute))
  # One global order: every process reads the global batch, keeps its rows.
  ds = ds.batch(batch_size * process_count, drop_remainder=True)
  if process_count > 1:
    ds = ds.map(lambda batch: mixing.rows_of_process(batch, process_index, batch_size))
  if batch_transform is not None:
    ds = ds.map(batch_transform)
  return ds


def make_iterator(
  config: DataConfig,
  *,
  split: str = "train",
  batch_size: int,
  seq_len: int,
  seed: int,
  process_index: int | None = None,
  process_count: int | None = None,
  batch_transform: Callable[[dict], dict] | None = None,
  with_sources: bool = False,
) -> grain.DatasetIterator:
  """Per-host iterator of batches: dict of numpy arrays, each [batch_size, seq_len]:
  inputs, targets, segment_ids, positions int32; loss_mask float32.

  split: 'train' | 'validation' (or any split the tfds dataset has).
  seq_len: tokens per row (the run's TrainConfig.seq_len); seed: shuffling and
    mixing seed (the run's TrainConfig.seed).
  batch_size: this process's rows; the global batch is batch_size x
    process_count rows, the same whatever the process count.
  process_index / process_count: this host's block of rows of each global
    batch; default jax.process_index() / jax.process_count(). Every host reads
    the whole global stream (documents read per host = all of them).
  batch_transform: applied last to every batch (e.g. the context-parallel
    zigzag reorder); it must be deterministic for resumption to be exact.
  with_sources: also `source_ids`, `document_lengths`, `document_starts` (see
    make_dataset), for reports and tests.
  The iterator's get_state() is a JSON-serialisable dict; set_state(state)
  resumes exactly. A finite num_epochs ends with StopIteration; a last partial
  batch is dropped.
  """
  return iter(
    make_dataset(
      config,
      split=split,
      batch_size=batch_size,
      seq_len=seq_len,
      seed=seed,
      process_index=process_index,
      process_count=process_count,
      batch_transform=batch_transform,
      with_sources=with_sources,
    )
  )


def make_tokenizer_for(config: DataConfig):
  """The tokenizer the pipeline uses for `config` (evals encode prompts with it)."""
  return make_tokenizer(config.tokenizer, config.tokenizer_model_path)


def document_source(config: DataConfig, spec: SourceSpec | str, split: str):
  """The random-access document source (raw bytes per item) of a corpus source
  (a SourceSpec or a DataConfig.sources name), or None for a synthetic one."""
  if isinstance(spec, str):
    spec = next(sp for c, sp in zip(config.sources, config.source_specs()) if spec in (c, sp.label))
  return streams.document_source(config, spec, split)


def load_documents(
  config: DataConfig, *, split: str = "validation", limit: int = 16, seed: int = 0
) -> list[str] | None:
  """Up to `limit` whole held-out documents as text, for the evals' 'text'
  haystack and context-use measurements.

  Drawn from the config's corpus sources, in a seeded order; among the first
  8 x limit candidates of each the `limit` longest are kept (in that order),
  because long-context evals need documents longer than their window. Invalid
  UTF-8 is decoded with U+FFFD. Returns None when the config has no corpus
  source (e.g. copy task only), so callers fall back to synthetic text.
  """
  corpora = [s for s in config.source_specs() if s.is_corpus and s.kind != "chat"]
  if not corpora:
    return None
  docs: list[str] = []
  for spec in corpora:
    source = streams.document_source(config, spec, split)
    order = np.random.default_rng(seed).permutation(len(source))[: 8 * limit]
    raws = [source[int(i)] for i in order]
    keep = set(np.argsort([-len(r) for r in raws], kind="stable")[:limit].tolist())
    docs += [raws[i].decode("utf-8", errors="replace") for i in range(len(raws)) if i in keep]
  return docs[:limit]


def skipped_rows(config: DataConfig, split: str = "train") -> dict[str, object]:
  """What DataConfig.skip_bad_rows left out of the row sources (jsonl,
  parquet): {'data/skipped_rows': n, 'data/first_skipped_row': 'file:line: why'}
  ({} when no source skipped a row)."""
  total, first = 0, ""
  for spec in config.source_specs():
    if spec.kind in ("jsonl", "parquet", "chat"):
      source = streams.document_source(config, spec, split)
      total += source.skipped_rows
      first = first or source.first_skipped_row
  return {"data/skipped_rows": total, "data/first_skipped_row": first} if total else {}
