"""Document sources: TFDS catalogue datasets and the local text-corpus builder.

Both are read the same way: `tfds` builder -> `as_data_source(split)` (array_record,
random access, no TensorFlow) -> `DocumentSource`, a grain-compatible random
access source whose items are the raw bytes of one document's text feature.

The local builder, `LctxTextCorpus`, turns a directory or glob of text files
(default: the Python stdlib sources + pydoc topics) into `train` and
`validation` splits. It is prepared automatically on first use into
`default_data_dir()`; catalogue datasets (pg19 ...) are never downloaded here,
they must already be prepared under their data_dir.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
from collections.abc import Sequence

import tensorflow_datasets as tfds
from etils import epath

from lctx.data import corpus, files

LOCAL_BUILDER_NAME = "lctx_text_corpus"
TEXT_FEATURE = "text"


def default_data_dir() -> str:
  """$LCTX_DATA_DIR, else ~/.cache/lctx/tfds."""
  return os.path.expanduser(
    os.environ.get("LCTX_DATA_DIR", os.path.join("~", ".cache", "lctx", "tfds"))
  )


class TextCorpusConfig(tfds.core.BuilderConfig):
  """One local corpus: its files, their kind ('text': a document per file;
  'jsonl' / 'parquet': a document per row, its `field`), validation fraction
  and bad-row policy (name = fingerprint)."""

  def __init__(
    self,
    *,
    text_glob: str,
    validation_fraction: float,
    kind: str = "text",
    field: str | None = None,
    skip_bad_rows: bool = False,
    **kwargs,
  ):
    super().__init__(**kwargs)
    self.text_glob = text_glob
    self.validation_fraction = validation_fraction
    self.kind, self.field, self.skip_bad_rows = kind, field, skip_bad_rows


class LctxTextCorpus(tfds.core.GeneratorBasedBuilder):
  """Text files -> array_record `train`/`validation` splits.

  Features: `text` (the document's raw bytes, kept exactly even when not valid
  UTF-8) and `key` (its path). Documents go to `validation` by a stable hash of
  their key, so the split does not depend on file order or machine.
  """

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = []  # configs are made per corpus by text_corpus_builder()

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    # tfds derives this from the package layout and, for a module inside a
    # package like lctx, reaches for `importlib_resources`, which a fresh venv
    # may lack; the builder needs no checksums file, so point at this file.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description="Local text corpus prepared by lctx.data.",
      features=tfds.features.FeaturesDict(
        {
          TEXT_FEATURE: tfds.features.Text(),
          "key": tfds.features.Text(),
        }
      ),
      # skipped_rows / first_skipped_row: what skip_bad_rows left out.
      metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is local
    cfg = self.builder_config
    if cfg.kind == "text":
      keys = corpus.list_documents(cfg.text_glob)
    else:  # one pass to find the rows (and the bad ones) before writing
      skipped = []
      keys = [k for k, _ in self._rows(skipped.append if cfg.skip_bad_rows else None)]
      self.info.metadata["skipped_rows"] = len(skipped)
      self.info.metadata["first_skipped_row"] = str(skipped[0]) if skipped else ""
      if not keys:
        raise ValueError(f"{cfg.kind} source {cfg.text_glob!r} has no readable rows.")
    train, val = corpus.split_keys(keys, cfg.validation_fraction)
    # tfds cannot write an empty split; validation_fraction=0 means none.
    splits = {"train": train, "validation": val}
    return {name: self._generate_examples(k) for name, k in splits.items() if k}

  def _rows(self, on_bad_row=None):
    """Every good row; a bad one raises unless on_bad_row takes it (or, past the
    first pass, which counted them, skip_bad_rows drops it)."""
    cfg = self.builder_config
    if on_bad_row is None and cfg.skip_bad_rows:
      on_bad_row = lambda error: None  # noqa: E731
    return files.iter_rows(cfg.kind, cfg.text_glob, cfg.field, on_bad_row)

  def _generate_examples(self, keys):
    glob = self.builder_config.text_glob
    if self.builder_config.kind == "text":
      for key in keys:
        yield key, {TEXT_FEATURE: corpus.read_document(key, glob), "key": key}
      return
    wanted = set(keys)
    for key, raw in self._rows():
      if key in wanted:
        yield key, {TEXT_FEATURE: raw, "key": key}


def text_corpus_builder(
  text_glob: str | None = None,
  *,
  data_dir: str | None = None,
  validation_fraction: float = 0.02,
  kind: str = "text",
  field: str | None = None,
  skip_bad_rows: bool = False,
) -> LctxTextCorpus:
  """The (unprepared or prepared) builder for one corpus. Raises ValueError if
  the corpus is missing or empty."""
  text_glob = text_glob or corpus.DEFAULT_CORPUS
  if kind == "text":
    corpus.list_documents(text_glob)  # fail early, with the message saying what to pass
    label = "stdlib" if text_glob == corpus.DEFAULT_CORPUS else "files"
  else:
    files.list_files(kind, text_glob)
    label = f"{kind}_{hashlib.sha1(f'{field}|{skip_bad_rows}'.encode()).hexdigest()[:6]}"
  name = f"{label}_{corpus.corpus_fingerprint(text_glob)}_v{int(validation_fraction * 1e4)}"
  config = TextCorpusConfig(
    name=name,
    version=LctxTextCorpus.VERSION,
    text_glob=text_glob,
    validation_fraction=validation_fraction,
    kind=kind,
    field=field,
    skip_bad_rows=skip_bad_rows,
    description=f"{kind} files {text_glob!r}",
  )
  # tfds warns "Using custom data configuration" for every per-corpus config;
  # that is the design here, not a problem, so keep it out of the run logs.
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  try:
    return LctxTextCorpus(
      config=config, data_dir=data_dir or default_data_dir(), file_format="array_record"
    )
  finally:
    absl_logger.setLevel(level)


def prepare_text_corpus(
  text_glob: str | None = None,
  *,
  data_dir: str | None = None,
  validation_fraction: float = 0.02,
  **row_options,
) -> LctxTextCorpus:
  """Prepares the corpus if it is not prepared yet (idempotent); returns it.
  row_options: kind, field, skip_bad_rows of text_corpus_builder."""
  builder = text_corpus_builder(
    text_glob, data_dir=data_dir, validation_fraction=validation_fraction, **row_options
  )
  if builder.is_prepared():
    return builder
  # Several processes on one machine (tests, simulated multi-host) may start
  # together: one prepares, the others wait for it instead of racing on the
  # final rename.
  root = data_dir or default_data_dir()
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, f".{LOCAL_BUILDER_NAME}.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      builder = text_corpus_builder(
        text_glob, data_dir=data_dir, validation_fraction=validation_fraction, **row_options
      )
      if not builder.is_prepared():
        builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(
            # Statistics over ~30 MB of text cost more than writing it.
            compute_stats=tfds.download.ComputeStatsMode.SKIP
          )
        )
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return builder


class DocumentSource(Sequence):
  """grain RandomAccessDataSource: item i = raw bytes of `feature` in record i."""

  def __init__(self, data_source, feature: str, description: str):
    self._source = data_source
    self._feature = feature
    self._description = description
    # Rows the reader skipped as bad (DataConfig.skip_bad_rows), and the first one.
    self.skipped_rows, self.first_skipped_row = 0, ""
    if len(data_source) == 0:
      raise ValueError(f"{description} has no records.")

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> bytes:
    record = self._source[index]
    value = record[self._feature]
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)

  def __repr__(self) -> str:
    return f"DocumentSource({self._description}, {len(self)} documents)"


def open_text_corpus(
  text_glob: str | None = None,
  *,
  split: str,
  data_dir: str | None = None,
  validation_fraction: float = 0.02,
  **row_options,
) -> DocumentSource:
  """The local corpus `split` ('train' | 'validation'), prepared on first use.
  row_options (kind='jsonl' | 'parquet', field, skip_bad_rows) read a document
  per row instead of per file."""
  builder = prepare_text_corpus(
    text_glob, data_dir=data_dir, validation_fraction=validation_fraction, **row_options
  )
  if split not in builder.info.splits:
    raise ValueError(
      f"text corpus {text_glob!r} has no split {split!r} (it has "
      f"{sorted(builder.info.splits.keys())}); 'validation' needs "
      f"validation_fraction > 0 (got {validation_fraction})."
    )
  kind = row_options.get("kind", "text")
  source = DocumentSource(
    builder.as_data_source(split=split),
    TEXT_FEATURE,
    f"{kind} corpus {text_glob or corpus.DEFAULT_CORPUS!r} [{split}]",
  )
  metadata = builder.info.metadata or {}
  source.skipped_rows = int(metadata.get("skipped_rows", 0))
  source.first_skipped_row = str(metadata.get("first_skipped_row", ""))
  return source


def open_tfds(
  name: str, *, split: str, feature: str, data_dir: str | None = None
) -> DocumentSource:
  """A prepared TFDS dataset (e.g. name='pg19', feature='book_text') by name.

  Never downloads: on these offline machines (and on a TPU VM reading a bucket)
  the dataset must already be prepared in array_record format under data_dir.
  """
  hint = (
    f"prepare it first, e.g. `tfds build {name} --data_dir={data_dir or '<dir>'} "
    "--file_format=array_record`, then pass that data_dir"
  )
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(f"TFDS dataset {name!r} is not a known dataset ({hint}).") from e
  if not builder.is_prepared():
    raise ValueError(f"TFDS dataset {name!r} is not prepared under data_dir={data_dir!r}; {hint}.")
  features = builder.info.features
  if feature not in features:
    raise ValueError(
      f"TFDS dataset {name!r} has no feature {feature!r}; it has {sorted(features.keys())}."
    )
  if split not in builder.info.splits and not re.match(r"\w+\[", split):
    raise ValueError(
      f"TFDS dataset {name!r} has no split {split!r}; it has {sorted(builder.info.splits.keys())}."
    )
  try:
    source = builder.as_data_source(split=split)
  except NotImplementedError as e:
    raise ValueError(
      f"TFDS dataset {name!r} under {data_dir!r} is not in a random "
      f"access format (array_record); {hint}."
    ) from e
  return DocumentSource(source, feature, f"tfds {name}/{feature} [{split}]")
