"""The grain pipeline: sources -> shard -> shuffle -> tokenize -> windows ->
mixture -> packing -> batch contract -> batches -> batch_transform.

    it = make_iterator(DataConfig(), split="train", batch_size=8, seq_len=1024, seed=0)
    batch = next(it)            # dict of numpy [8, 1024], see docs/contracts.md
    state = it.get_state()      # JSON-serialisable; store it in the checkpoint
    it.set_state(state)         # resumes exactly: the same batches follow

Every random choice derives from `seed` and element indices (grain's index
shuffles, per-document rngs), never from wall-clock or thread timing, so two
runs with one seed give identical batches and a restored state continues the
uninterrupted stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grain
import numpy as np

from lctx.data import packing as packing_lib
from lctx.data import sources as sources_lib
from lctx.data import synthetic
from lctx.data.tokenizers import make_tokenizer

SOURCE_KINDS = ("text", "tfds", "copy")
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
  if name in SOURCE_KINDS:
    raise ValueError(f"task source name {name!r} collides with a built-in source.")
  _TASK_SOURCES[name] = make_document


def task_source_names() -> tuple[str, ...]:
  return tuple(_TASK_SOURCES)


_COPY_TASK_SIZE = 2**31 - 1  # documents per epoch of the (endless) copy task


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """What to read and how to pack it. Each field is a plain gin-bindable value."""

  sources: tuple[str, ...] = ("text",)
  """Sources mixed into the stream: 'text' (local corpus builder over text_glob),
  'tfds' (catalogue dataset tfds_name/tfds_feature), 'copy' (synthetic copy task;
  needs no corpus)."""
  weights: tuple[float, ...] = ()
  """Mixture weight per source, normalised by grain; () = equal weights. Weights
  count documents (after windowing: each window is one draw), not tokens."""
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

  def __post_init__(self):
    if not self.sources:
      raise ValueError("DataConfig.sources is empty; use e.g. ('text',) or ('copy',).")
    for s in self.sources:
      if s not in SOURCE_KINDS and s not in _TASK_SOURCES:
        raise ValueError(
          f"unknown data source {s!r}; expected one of {SOURCE_KINDS + task_source_names()}."
        )
    if len(set(self.sources)) != len(self.sources):
      raise ValueError(f"DataConfig.sources has duplicates: {self.sources}.")
    if self.weights and len(self.weights) != len(self.sources):
      raise ValueError(
        f"DataConfig.weights has {len(self.weights)} entries for "
        f"{len(self.sources)} sources {self.sources}."
      )
    if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
      raise ValueError(f"DataConfig.weights must be >= 0 with a positive sum: {self.weights}.")
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


def _encode_document(raw: bytes, tokenizer, add_bos: bool, add_eos: bool) -> dict[str, np.ndarray]:
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


def document_source(config: DataConfig, kind: str, split: str):
  """The random-access document source of one kind (bytes per item), or None
  for the synthetic kinds, which are generated from indices."""
  if kind == "text":
    return sources_lib.open_text_corpus(
      config.text_glob,
      split=split,
      data_dir=config.data_dir,
      validation_fraction=config.validation_fraction,
    )
  if kind == "tfds":
    return sources_lib.open_tfds(
      config.tfds_name, split=split, feature=config.tfds_feature, data_dir=config.tfds_data_dir
    )
  return None


def _source_dataset(
  config: DataConfig,
  kind: str,
  *,
  split: str,
  seq_len: int,
  seed: int,
  process_index: int,
  process_count: int,
  tokenizer,
) -> grain.IterDataset:
  """One source as a stream of windows, this process's shard only."""

  def cap(index: int) -> int:  # the synthetic length curriculum (DataConfig)
    n, start = config.synthetic_ramp_documents, min(config.synthetic_ramp_start, seq_len)
    if n <= 0 or index >= n:
      return seq_len
    return start + (seq_len - start) * index // n

  if kind == "copy":

    def make_copy(index: int) -> dict[str, np.ndarray]:
      tokens, mask = synthetic.copy_document(
        index,
        seed=seed,
        split=split,
        max_tokens=cap(index),
        tokenizer=tokenizer,
        min_key_len=config.copy_min_key_len,
        max_key_len=config.copy_max_key_len,
        loss_on=config.copy_loss_on,
      )
      return {"tokens": tokens, "target_mask": mask}

    ds = grain.MapDataset.range(_COPY_TASK_SIZE)
    # Shard by index first so the processes' documents are disjoint.
    ds = ds[process_index::process_count].map(make_copy)
  elif kind in _TASK_SOURCES:
    make_document = _TASK_SOURCES[kind]

    def make_task(index: int) -> dict[str, np.ndarray]:
      tokens, mask = make_document(
        index, seed=seed, split=split, max_tokens=cap(index), tokenizer=tokenizer
      )
      return {"tokens": np.asarray(tokens, np.int32), "target_mask": np.asarray(mask, np.float32)}

    ds = grain.MapDataset.range(_COPY_TASK_SIZE)[process_index::process_count]
    ds = ds.map(make_task)
  else:
    source = document_source(config, kind, split)
    if len(source) < process_count:
      raise ValueError(
        f"{source!r} has {len(source)} documents, fewer than "
        f"process_count={process_count}: some hosts would get none."
      )
    ds = grain.MapDataset.source(source)[process_index::process_count]
    # shuffle before repeat: each epoch gets its own permutation (seed + epoch).
    ds = ds.shuffle(seed=seed).repeat(config.num_epochs)
    ds = ds.map(lambda raw: _encode_document(raw, tokenizer, config.add_bos, config.add_eos))
  it = ds.to_iter_dataset(
    grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=64)
  )
  ds = grain.experimental.FlatMapIterDataset(
    it, packing_lib.WindowDocument(seq_len, config.continuation_positions)
  )
  if config.window_shuffle_size > 1:
    # A long document yields many consecutive windows; without this they fill
    # whole batches by themselves. Checkpoint state stays small (grain refills
    # the window from the parent state at restore).
    ds = grain.experimental.WindowShuffleIterDataset(
      ds, window_size=config.window_shuffle_size, seed=seed
    )
  return ds


def packing_bins(config: DataConfig, seq_len: int) -> int:
  if config.num_packing_bins is not None:
    return config.num_packing_bins
  return min(256, max(8, 2**22 // seq_len))


def _pack(ds: grain.IterDataset, config: DataConfig, seq_len: int, seed: int) -> grain.IterDataset:
  lengths = {k: seq_len for k in packing_lib.PACKED_FEATURES}
  if config.packing == "first_fit":
    return grain.experimental.FirstFitPackIterDataset(
      ds,
      length_struct=lengths,
      num_packing_bins=packing_bins(config, seq_len),
      seed=seed,
      shuffle_bins=True,
      # Carried along without segment ids/positions of their own.
      meta_features=("positions", "loss_mask"),
    )
  return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)


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
) -> grain.IterDataset:
  """The grain IterDataset behind make_iterator (same arguments)."""
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
  min_copy = synthetic.min_copy_seq_len(config.copy_max_key_len)
  if "copy" in config.sources and seq_len < min_copy:
    raise ValueError(
      f"the copy task needs seq_len >= {min_copy} for copy_max_key_len="
      f"{config.copy_max_key_len}; got seq_len={seq_len} "
      "(lower copy_max_key_len or raise seq_len)."
    )
  if (
    "copy" in config.sources
    and config.synthetic_ramp_documents
    and config.synthetic_ramp_start < min_copy
  ):
    raise ValueError(
      f"the copy task needs synthetic_ramp_start >= {min_copy} for copy_max_key_len="
      f"{config.copy_max_key_len}; got {config.synthetic_ramp_start}."
    )
  tokenizer = make_tokenizer(config.tokenizer, config.tokenizer_model_path)
  streams = [
    # Each source gets its own seed so adding one does not reshuffle others.
    _source_dataset(
      config,
      kind,
      split=split,
      seq_len=seq_len,
      seed=(seed * 1_000_003 + i) % 2**32,
      process_index=process_index,
      process_count=process_count,
      tokenizer=tokenizer,
    )
    for i, kind in enumerate(config.sources)
  ]
  if len(streams) == 1:
    ds = streams[0]
  else:
    weights = list(config.weights) or [1.0] * len(streams)
    ds = grain.IterDataset.mix(
      dict(zip(config.sources, streams)), dict(zip(config.sources, weights))
    )
  ds = _pack(ds, config, seq_len, seed)
  absolute = config.continuation_positions == "absolute"
  ds = ds.map(lambda row: packing_lib.to_batch_contract(row, absolute=absolute))
  ds = ds.batch(batch_size, drop_remainder=True)
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
) -> grain.DatasetIterator:
  """Per-host iterator of batches: dict of numpy arrays, each [batch_size, seq_len]:
  inputs, targets, segment_ids, positions int32; loss_mask float32.

  split: 'train' | 'validation' (or any split the tfds dataset has).
  seq_len: tokens per row (the run's TrainConfig.seq_len); seed: shuffling and
    mixing seed (the run's TrainConfig.seed).
  process_index / process_count: this host's shard; default jax.process_index()
    / jax.process_count(). Hosts read disjoint documents.
  batch_transform: applied last to every batch (e.g. the context-parallel
    zigzag reorder); it must be deterministic for resumption to be exact.
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
    )
  )


def make_tokenizer_for(config: DataConfig):
  """The tokenizer the pipeline uses for `config` (evals encode prompts with it)."""
  return make_tokenizer(config.tokenizer, config.tokenizer_model_path)


def load_documents(
  config: DataConfig, *, split: str = "validation", limit: int = 16, seed: int = 0
) -> list[str] | None:
  """Up to `limit` whole held-out documents as text, for the evals' 'text'
  haystack and context-use measurements.

  Drawn from the config's corpus sources ('text', 'tfds'), in a seeded order;
  among the first 8 x limit candidates the `limit` longest are kept (in that
  order), because long-context evals need documents longer than their window.
  Invalid UTF-8 is decoded with U+FFFD. Returns None when the config has no
  corpus source (e.g. copy task only), so callers fall back to synthetic text.
  """
  docs: list[str] = []
  for kind in config.sources:
    source = document_source(config, kind, split)
    if source is None:
      continue
    order = np.random.default_rng(seed).permutation(len(source))[: 8 * limit]
    raws = [source[int(i)] for i in order]
    keep = set(np.argsort([-len(r) for r in raws], kind="stable")[:limit].tolist())
    docs += [raws[i].decode("utf-8", errors="replace") for i in range(len(raws)) if i in keep]
  if not any(kind in ("text", "tfds") for kind in config.sources):
    return None
  return docs[:limit]
