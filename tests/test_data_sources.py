"""Sources: the local corpus builder (real default corpus), clear errors, and a
PG-19-shaped TFDS dataset read through the same reader as pg19."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from lctx.data import corpus, sources
from lctx.data.pipeline import DataConfig, make_iterator
from lctx.data.tokenizers import ByteTokenizer


class TinyPg19(tfds.core.GeneratorBasedBuilder):
  """Same features as the catalogue `pg19`, a handful of generated books."""

  VERSION = tfds.core.Version("0.1.1")

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      features=tfds.features.FeaturesDict(
        {
          "book_id": np.int32,
          "book_link": tfds.features.Text(),
          "book_text": tfds.features.Text(),
          "book_title": tfds.features.Text(),
          "publication_date": tfds.features.Text(),
        }
      ),
    )

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(0, 6), "validation": self._generate_examples(6, 8)}

  def _generate_examples(self, lo, hi):
    for i in range(lo, hi):
      text = f"BOOK {i}. " + " ".join(["It was a dark and stormy night."] * (20 + 10 * i))
      yield (
        i,
        {
          "book_id": i,
          "book_link": f"http://x/{i}",
          "book_text": text,
          "book_title": f"Book {i}",
          "publication_date": "1900",
        },
      )


@pytest.fixture(scope="module")
def tiny_pg19_dir(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  TinyPg19(data_dir=data_dir, file_format="array_record").download_and_prepare(
    download_config=tfds.download.DownloadConfig(compute_stats=tfds.download.ComputeStatsMode.SKIP)
  )
  return data_dir


def test_pg19_shaped_dataset_through_the_tfds_reader(tiny_pg19_dir):
  src = sources.open_tfds(
    "tiny_pg19", split="validation", feature="book_text", data_dir=tiny_pg19_dir
  )
  assert len(src) == 2 and {src[i][:6] for i in range(2)} == {b"BOOK 6", b"BOOK 7"}
  config = DataConfig(
    sources=("tfds", "copy"),
    tfds_name="tiny_pg19",
    tfds_feature="book_text",
    tfds_data_dir=tiny_pg19_dir,
    num_packing_bins=8,
    window_shuffle_size=4,
  )
  it = make_iterator(config, batch_size=4, seq_len=256, seed=0, process_index=0, process_count=1)
  tok = ByteTokenizer()
  text = "".join(tok.decode(next(it)["inputs"].reshape(-1)) for _ in range(6))
  assert "BOOK " in text and "dark and stormy" in text and "copy: " in text


def test_tfds_errors_say_what_to_do(tiny_pg19_dir, tmp_path):
  with pytest.raises(ValueError, match="not prepared .*tfds build pg19"):
    sources.open_tfds("pg19", split="train", feature="book_text", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="not a known dataset"):
    sources.open_tfds("no_such_dataset_xyz", split="train", feature="t", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match=r"no feature 'text'.*book_text"):
    sources.open_tfds("tiny_pg19", split="train", feature="text", data_dir=tiny_pg19_dir)
  with pytest.raises(ValueError, match="no split 'test'"):
    sources.open_tfds("tiny_pg19", split="test", feature="book_text", data_dir=tiny_pg19_dir)


def test_missing_or_empty_corpus_is_clear_error(tmp_path):
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "blank.txt").write_bytes(b"")
  for glob in (str(tmp_path / "empty"), str(tmp_path / "nothing" / "*.txt")):
    with pytest.raises(ValueError, match="missing or empty.*text_glob="):
      sources.open_text_corpus(glob, split="train", data_dir=str(tmp_path / "cache"))


def test_local_builder_subset_glob_and_splits(tmp_path):
  stdlib = corpus.stdlib_dir()
  glob = f"{stdlib}/json/*.py"  # a real subset of the default corpus: fast
  train = sources.open_text_corpus(glob, split="train", data_dir=str(tmp_path))
  val = sources.open_text_corpus(glob, split="validation", data_dir=str(tmp_path))
  files = corpus.expand_glob(glob)
  assert len(train) + len(val) == len(files) and len(val) >= 1
  texts = {train[i] for i in range(len(train))} | {val[i] for i in range(len(val))}
  assert texts == {open(f, "rb").read() for f in files}


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("default_cache"))


def test_default_corpus_prepares_offline(default_cache):
  """The real default: every stdlib .py file and pydoc topic, both splits."""
  keys = corpus.list_documents()
  assert len(keys) > 1000 and "os.py" in keys and "pydoc_data.topics/if" in keys
  train = sources.open_text_corpus(split="train", data_dir=default_cache)
  val = sources.open_text_corpus(split="validation", data_dir=default_cache)
  assert len(train) + len(val) == len(keys)
  assert 0.005 * len(keys) < len(val) < 0.05 * len(keys)
  lengths = np.array([len(train[i]) for i in range(0, len(train), 10)])
  assert np.median(lengths) > 2000  # long documents, as the issue promises
  # Prepared once: a second open reuses the cache instead of rewriting it.
  builder = sources.text_corpus_builder(data_dir=default_cache)
  assert builder.is_prepared()


def test_default_config_first_fit_fill_ratio(default_cache):
  """The issue's packing target on the default config (byte, first-fit, 1024)."""
  it = make_iterator(
    DataConfig(data_dir=default_cache),
    batch_size=8,
    seq_len=1024,
    seed=0,
    process_index=0,
    process_count=1,
  )
  seg = np.stack([next(it)["segment_ids"] for _ in range(100)])  # 800 rows
  assert (seg > 0).mean() >= 0.98


def test_split_never_leaves_train_empty_and_ignores_where_the_corpus_lives():
  keys = [f"/data/books/d{i}.txt" for i in range(4)]
  # A fraction near 1 puts every document in validation by hash; one stays in train.
  train, val = corpus.split_keys(keys, 0.999)
  assert train and val and sorted(train + val) == keys
  # Few documents and a small fraction: validation still gets one.
  train, val = corpus.split_keys(keys, 0.001)
  assert train and val and sorted(train + val) == keys
  # The same files under another directory split the same way.
  for fraction in (0.3, 0.5):
    a = corpus.split_keys(keys, fraction)
    moved = [k.replace("/data/books", "/tmp/pytest-of-ci/pytest-49/x/docs") for k in keys]
    b = corpus.split_keys(moved, fraction)
    assert [[k.rsplit("/", 1)[1] for k in part] for part in a] == [
      [k.rsplit("/", 1)[1] for k in part] for part in b
    ]
  assert corpus.split_keys(keys, 0.0) == (keys, [])
