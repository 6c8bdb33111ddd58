"""Source specs: jsonl / parquet / text / copy mixed by tokens, length filters and
upsampling, one global order across processes, resume, bad input, inspect_data.

The corpus is scripts/make_mix_corpus.py's (stdlib sources and pydoc topics),
a few documents per domain."""

import gzip
import json
import os
import sys

import numpy as np
import pytest

from lctx.data import inspect_data, skipped_rows
from lctx.data.pipeline import DataConfig, make_iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_mix_corpus  # noqa: E402

S = 256


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("mix"))
  make_mix_corpus.write(out, max_docs=8)
  return out


def _config(mix, cache, **overrides):
  sources = (
    {"kind": "jsonl", "path": f"{mix}/code", "field": "content", "weight": 0.5},
    {"kind": "parquet", "path": f"{mix}/arxiv", "field": "text", "weight": 0.2},
    {"kind": "text", "path": f"{mix}/books", "weight": 0.3},
  )
  base = dict(
    sources=sources,
    data_dir=str(cache),
    validation_fraction=0.1,
    num_packing_bins=16,
    window_shuffle_size=8,
  )
  return DataConfig(**{**base, **overrides})


def _take(config, n, **kwargs):
  kwargs = dict(dict(batch_size=4, seq_len=S, seed=0, process_index=0, process_count=1), **kwargs)
  it = make_iterator(config, **kwargs)
  return [next(it) for _ in range(n)]


def test_token_shares_follow_the_weights_within_one_percent(mix, tmp_path):
  config = _config(mix, tmp_path)
  counts = np.zeros(4, np.int64)
  it = make_iterator(
    config, batch_size=16, seq_len=S, seed=0, process_index=0, process_count=1, with_sources=True
  )
  while counts[1:].sum() < 10**6:
    ids = next(it)["source_ids"]
    counts += np.bincount(ids.ravel(), minlength=4)
  shares = counts[1:] / counts[1:].sum()
  np.testing.assert_allclose(shares, [0.5, 0.2, 0.3], atol=0.01)
  # The same weights as document draws would not: arxiv rows are short.
  assert counts[0] / counts.sum() < 0.05  # few pads


def test_old_string_sources_and_dicts_mix(mix, tmp_path):
  config = DataConfig(
    sources=("copy", {"kind": "jsonl", "path": f"{mix}/short", "field": "text", "name": "short"}),
    weights=(0.25, 0.75),
    data_dir=str(tmp_path),
    copy_max_key_len=12,
    num_packing_bins=16,  # the packer holds fewer tokens than the 40 batches read
  )
  assert [s.label for s in config.source_specs()] == ["copy", "short"]
  ids = np.concatenate([b["source_ids"] for b in _take(config, 40, with_sources=True)])
  share = (ids == 2).sum() / (ids > 0).sum()
  assert abs(share - 0.75) < 0.02


def test_length_filters_and_upsampling_shape_the_histogram(mix, tmp_path):
  """One epoch of one source: documents >= 20,000 tokens come 3 times, the ones
  under 2,000 not at all; counted from the documents that begin in the batches."""
  from lctx.data import streams

  base = {"kind": "parquet", "path": f"{mix}/arxiv", "field": "text"}
  plain = _config(mix, tmp_path, sources=(base,), num_epochs=1, validation_fraction=0.0)
  spec = dict(base, min_tokens=2000, upsample=((8000, 2.0), (20000, 3.0)))
  shaped = _config(mix, tmp_path, sources=(spec,), num_epochs=1, validation_fraction=0.0)
  source = streams.document_source(plain, plain.source_specs()[0], "train")
  lengths = np.array([len(source[i]) + 2 for i in range(len(source))])
  assert (lengths < 2000).any() and (lengths >= 20000).any()  # the test can fail

  def starts(config):
    out = []
    for b in make_iterator(
      config, batch_size=1, seq_len=S, seed=0, process_index=0, process_count=1, with_sources=True
    ):
      out += b["document_lengths"][b["document_starts"] > 0].tolist()
    return sorted(out)

  assert starts(plain) == sorted(lengths.tolist())
  factor = np.where(lengths >= 20000, 3, np.where(lengths >= 8000, 2, 1))
  want = np.repeat(lengths, np.where(lengths >= 2000, factor, 0))
  assert starts(shaped) == sorted(want.tolist())


def test_max_windows_per_document_caps_each_document(mix, tmp_path):
  spec = {"kind": "text", "path": f"{mix}/books", "max_windows_per_document": 2}
  config = _config(mix, tmp_path, sources=(spec,), continuation_positions="absolute")
  positions = np.concatenate([b["positions"] for b in _take(config, 30)])
  assert positions.max() < 2 * S and positions.max() >= S


def test_resume_with_several_sources_is_exact(mix, tmp_path):
  config = _config(mix, tmp_path)
  kwargs = dict(batch_size=2, seq_len=S, seed=5, process_index=0, process_count=1)
  it = make_iterator(config, **kwargs)
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(5)]
  resumed = make_iterator(config, **kwargs)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_processes_read_disjoint_rows_of_one_global_batch(mix, tmp_path):
  """2 processes x 2 rows and 4 x 1 give the rows of 1 process x 4, step after
  step; a state saved on 2 processes resumes the same stream on 1."""
  config = _config(mix, tmp_path)
  whole = _take(config, 6, batch_size=4)
  for count in (2, 4):
    parts = [
      _take(config, 6, batch_size=4 // count, process_index=i, process_count=count)
      for i in range(count)
    ]
    for step, want in enumerate(whole):
      for k in want:
        np.testing.assert_array_equal(np.concatenate([p[step][k] for p in parts]), want[k])
  it = make_iterator(config, batch_size=2, seq_len=S, seed=0, process_index=1, process_count=2)
  for _ in range(3):
    next(it)
  one = make_iterator(config, batch_size=4, seq_len=S, seed=0, process_index=0, process_count=1)
  one.set_state(it.get_state())
  np.testing.assert_array_equal(next(one)["inputs"], whole[3]["inputs"])


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------
def _jsonl_source(tmp_path, lines, name="bad.jsonl", skip=False):
  path = tmp_path / "rows" / name
  path.parent.mkdir(exist_ok=True)
  data = "".join(line + "\n" for line in lines).encode()
  if name.endswith(".gz"):
    data = gzip.compress(data)
  path.write_bytes(data)
  return DataConfig(
    sources=({"kind": "jsonl", "path": str(path), "field": "text"},),
    data_dir=str(tmp_path / "cache"),
    validation_fraction=0.0,
    skip_bad_rows=skip,
  )


GOOD = [json.dumps({"text": f"row {i} " * 20}) for i in range(30)]


@pytest.mark.parametrize(
  "lines,error",
  [
    (GOOD[:3] + ["{not json"] + GOOD[3:], r"bad\.jsonl:4: line 4 is not JSON"),
    (
      GOOD[:5] + [json.dumps({"body": "x"})] + GOOD[5:],
      r"bad\.jsonl:6: line 6 has no field 'text'",
    ),
    (GOOD[:2] + [json.dumps({"text": None})], r"bad\.jsonl:3: field 'text' is null"),
  ],
)
def test_bad_rows_name_the_file_and_line(tmp_path, lines, error):
  config = _jsonl_source(tmp_path, lines)
  with pytest.raises(ValueError, match=error + r".*skip_bad_rows"):
    _take(config, 1, seq_len=64)


def test_truncated_gzip_and_parquet_name_the_file(tmp_path):
  path = tmp_path / "rows" / "cut.jsonl.gz"
  config = _jsonl_source(tmp_path, GOOD * 20, name="cut.jsonl.gz")
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match=r"cut\.jsonl\.gz:\d+: the file is truncated or corrupt"):
    _take(config, 1, seq_len=64)
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq_path = tmp_path / "pq" / "cut.parquet"
  pq_path.parent.mkdir()
  pq.write_table(pa.table({"text": [f"doc {i}" for i in range(100)]}), str(pq_path))
  pq_path.write_bytes(pq_path.read_bytes()[:-40])
  config = DataConfig(
    sources=({"kind": "parquet", "path": str(pq_path), "field": "text"},),
    data_dir=str(tmp_path / "cache"),
  )
  with pytest.raises(ValueError, match=r"cut\.parquet: not a readable parquet file"):
    _take(config, 1, seq_len=64)


def test_missing_path_and_field_are_clear(tmp_path):
  with pytest.raises(ValueError, match=r"path '.*nowhere' is missing"):
    _take(
      DataConfig(sources=({"kind": "jsonl", "path": str(tmp_path / "nowhere"), "field": "t"},)),
      1,
    )
  with pytest.raises(ValueError, match="needs 'field'"):
    DataConfig(sources=({"kind": "parquet", "path": "/x"},))
  with pytest.raises(ValueError, match="unknown keys \\['weigth'\\]"):
    DataConfig(sources=({"kind": "text", "path": "/x", "weigth": 1},))
  with pytest.raises(ValueError, match="duplicates.*'name'"):
    DataConfig(sources=({"kind": "text", "path": "/a/x"}, {"kind": "text", "path": "/b/x"}))


def test_skip_bad_rows_counts_them_and_names_the_first(tmp_path):
  lines = GOOD[:3] + ["{not json"] + GOOD[3:6] + [json.dumps({"x": 1})] + GOOD[6:]
  config = _jsonl_source(tmp_path, lines, skip=True)
  batches = _take(config, 2, seq_len=64)
  assert batches[0]["inputs"].shape == (4, 64)
  record = skipped_rows(config)
  assert record["data/skipped_rows"] == 2
  assert record["data/first_skipped_row"].startswith(f"{tmp_path}/rows/bad.jsonl:4: line 4")


# ----------------------------------------------------------------------------
# inspect_data
# ----------------------------------------------------------------------------
def test_inspect_data_writes_the_contract(mix, tmp_path):
  config = _config(mix, tmp_path)
  path = str(tmp_path / "inspect_data.json")
  report = inspect_data(config, batch_size=8, seq_len=S, num_batches=40, json_path=path)
  with open(path) as f:
    record = json.load(f)
  assert 0.9 < record["fill_ratio"] <= 1.0
  names = [s["name"] for s in record["sources"]]
  assert names == ["jsonl:code", "parquet:arxiv", "text:books"]
  for s, weight in zip(record["sources"], (0.5, 0.2, 0.3)):
    assert set(s) >= {"name", "weight", "token_share", "documents", "tokens", "length_histogram"}
    assert s["weight"] == pytest.approx(weight) and abs(s["token_share"] - weight) < 0.02
    hist = s["length_histogram"]
    assert sum(hist["tokens"]) == s["tokens"] and sum(hist["documents"]) == s["documents"]
  total = sum(s["tokens"] for s in record["sources"])
  assert total == pytest.approx(record["fill_ratio"] * 40 * 8 * S)
  # Code repositories (a stdlib package each) are all longer than a window.
  assert record["sources"][0]["long_document_token_share"] == 1.0
  assert "in_long_docs" in report and "fill_ratio: " in report


def test_a_data_state_saved_by_every_process_alike_restores_on_another_count():
  from lctx import checkpoint as ckpt_lib

  own = ckpt_lib.Checkpointer._own_data_state  # pylint: disable=protected-access
  same = {"processes": [{"a": 1}, {"a": 1}]}
  assert own(None, 2, same) == {"a": 1}  # a global order: any process count
  assert own(None, 2, {"processes": [{"a": 1}, {"a": 2}]}) == {}  # per-process shards
