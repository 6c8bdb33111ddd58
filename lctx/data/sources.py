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
import logging
import os
import re
from collections.abc import Sequence

import tensorflow_datasets as tfds
from etils import epath

from lctx.data import corpus

LOCAL_BUILDER_NAME = "lctx_text_corpus"
TEXT_FEATURE = "text"


def default_data_dir() -> str:
  """$LCTX_DATA_DIR, else ~/.cache/lctx/tfds."""
  return os.path.expanduser(
    os.environ.get("LCTX_DATA_DIR", os.path.join("~", ".cache", "lctx", "tfds"))
  )


class TextCorpusConfig(tfds.core.BuilderConfig):
  """One local corpus: its glob and validation fraction (name = fingerprint)."""

  def __init__(self, *, text_glob: str, validation_fraction: float, **kwargs):
    super().__init__(**kwargs)
    self.text_glob = text_glob
    self.validation_fraction = validation_fraction


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
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is local
    cfg = self.builder_config
    keys = corpus.list_documents(cfg.text_glob)
    train, val = corpus.split_keys(keys, cfg.validation_fraction)
    # tfds cannot write an empty split; validation_fraction=0 means none.
    splits = {"train": train, "validation": val}
    return {name: self._generate_examples(k) for name, k in splits.items() if k}

  def _generate_examples(self, keys):
    glob = self.builder_config.text_glob
    for key in keys:
      yield key, {TEXT_FEATURE: corpus.read_document(key, glob), "key": key}


def text_corpus_builder(
  text_glob: str | None = None, *, data_dir: str | None = None, validation_fraction: float = 0.02
) -> LctxTextCorpus:
  """The (unprepared or prepared) builder for one corpus. Raises ValueError if
  the corpus is missing or empty."""
  text_glob = text_glob or corpus.DEFAULT_CORPUS
  corpus.list_documents(text_glob)  # fail early, with the message saying what to pass
  label = "stdlib" if text_glob == corpus.DEFAULT_CORPUS else "files"
  name = f"{label}_{corpus.corpus_fingerprint(text_glob)}_v{int(validation_fraction * 1e4)}"
  config = TextCorpusConfig(
    name=name,
    version=LctxTextCorpus.VERSION,
    text_glob=text_glob,
    validation_fraction=validation_fraction,
    description=f"text files {text_glob!r}",
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
  text_glob: str | None = None, *, data_dir: str | None = None, validation_fraction: float = 0.02
) -> LctxTextCorpus:
  """Prepares the corpus if it is not prepared yet (idempotent); returns it."""
  builder = text_corpus_builder(
    text_glob, data_dir=data_dir, validation_fraction=validation_fraction
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
        text_glob, data_dir=data_dir, validation_fraction=validation_fraction
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
) -> DocumentSource:
  """The local corpus `split` ('train' | 'validation'), prepared on first use."""
  builder = prepare_text_corpus(
    text_glob, data_dir=data_dir, validation_fraction=validation_fraction
  )
  if split not in builder.info.splits:
    raise ValueError(
      f"text corpus {text_glob!r} has no split {split!r} (it has "
      f"{sorted(builder.info.splits.keys())}); 'validation' needs "
      f"validation_fraction > 0 (got {validation_fraction})."
    )
  return DocumentSource(
    builder.as_data_source(split=split),
    TEXT_FEATURE,
    f"text corpus {text_glob or corpus.DEFAULT_CORPUS!r} [{split}]",
  )


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
