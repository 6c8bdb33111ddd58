"""grain pipeline: packing exactness, positions, determinism, resume, sharding,
mixtures and the copy task, on a tiny local corpus (fast)."""

import collections
import dataclasses
import json
import re

import numpy as np
import pytest

from lctx.data import inspect_data
from lctx.data.pipeline import DataConfig, make_iterator
from lctx.data.tokenizers import ByteTokenizer

S = 64  # row length used throughout: small, so documents span several windows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """12 documents of 10..300 bytes, each starting with a unique header, one with
  invalid UTF-8; returns (DataConfig, {key: raw bytes})."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(1)
  docs = {}
  for i in range(12):
    body = bytes(rng.integers(32, 127, int(rng.integers(10, 300))).astype(np.uint8))
    raw = f"doc-{i:02d}\n".encode() + body
    if i == 3:
      raw += b"\xff\xfe broken \xe2\x82"
    path = root / "texts" / f"d{i:02d}.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(raw)
    docs[str(path)] = raw
  config = DataConfig(
    text_glob=str(root / "texts"),
    data_dir=str(root / "cache"),
    validation_fraction=0.2,
    num_epochs=1,
    num_packing_bins=8,
    window_shuffle_size=4,
    copy_max_key_len=12,
  )
  return config, docs


def _train_docs(config):
  from lctx.data import open_text_corpus

  src = open_text_corpus(
    config.text_glob,
    split="train",
    data_dir=config.data_dir,
    validation_fraction=config.validation_fraction,
  )
  return [src[i] for i in range(len(src))]


def _all_batches(it):
  return list(it)


def _pieces(batches):
  """Every (inputs, targets, positions, loss_mask) segment of every row."""
  out = []
  for b in batches:
    for r in range(b["inputs"].shape[0]):
      seg = b["segment_ids"][r]
      for s in np.unique(seg[seg > 0]):
        idx = np.flatnonzero(seg == s)
        assert np.all(np.diff(idx) == 1), "a segment must be contiguous"
        out.append(tuple(b[k][r, idx] for k in ("inputs", "targets", "positions", "loss_mask")))
  return out


def _expected_windows(docs, absolute=True):
  tok = ByteTokenizer()
  out = []
  for raw in docs:
    t = np.concatenate([[1], tok.encode_bytes(raw), [2]])
    for start in range(0, len(t) - 1, S):
      end = min(start + S, len(t) - 1)
      first = start if absolute else 0
      out.append((t[start:end], t[start + 1 : end + 1], np.arange(first, first + end - start)))
  return out


def _key(piece):
  return tuple(np.concatenate([np.asarray(x, np.int64) for x in piece[:3]]).tolist())


@pytest.mark.parametrize("positions", ["absolute", "restart"])
def test_first_fit_loses_no_token_and_pads_only_at_row_ends(corpus, positions):
  config, _ = corpus
  config = DataConfig(**{**config.__dict__, "continuation_positions": positions})
  batches = _all_batches(
    make_iterator(config, seq_len=S, batch_size=1, seed=0, process_index=0, process_count=1)
  )
  for b in batches:
    for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
      assert b[k].shape == (1, S)
    seg = b["segment_ids"][0]
    real = np.flatnonzero(seg > 0)
    # Pads only at the end; ids 1, 2, ... in order.
    assert real.size and np.all(real == np.arange(real.size))
    assert np.all(np.diff(seg[real]) >= 0) and seg[0] == 1
    assert np.array_equal(np.unique(seg[real]), np.arange(1, seg.max() + 1))
    assert np.array_equal(b["loss_mask"][0], (seg > 0).astype(np.float32))
    assert np.all(b["inputs"][0][seg == 0] == 0) and np.all(b["positions"][0][seg == 0] == 0)
  got = collections.Counter(_key(p) for p in _pieces(batches))
  want = collections.Counter(
    _key(w) for w in _expected_windows(_train_docs(config), positions == "absolute")
  )
  assert got == want  # every window exactly once, every token, exact positions
  # Long documents really were cut (the test would be vacuous otherwise).
  assert sum(1 for w in want if len(w) == 3 * S) >= 3


def test_concat_split_keeps_every_token(corpus):
  config, _ = corpus
  config = DataConfig(**{**config.__dict__, "packing": "concat_split"})
  batches = _all_batches(
    make_iterator(config, seq_len=S, batch_size=1, seed=0, process_index=0, process_count=1)
  )
  real = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
  want = sum(len(w[0]) for w in _expected_windows(_train_docs(config)))
  assert real == want
  assert all((b["segment_ids"] > 0).all() for b in batches[:-1])  # no padding
  for inputs, targets, positions, _ in _pieces(batches):
    # Positions stay absolute and contiguous inside each piece, even after a cut.
    assert np.all(np.diff(positions) == 1)


def test_positions_restart_or_continue(corpus):
  config, _ = corpus
  for mode in ("absolute", "restart"):
    cfg = DataConfig(**{**config.__dict__, "continuation_positions": mode})
    pieces = _pieces(
      _all_batches(
        make_iterator(cfg, seq_len=S, batch_size=2, seed=0, process_index=0, process_count=1)
      )
    )
    firsts = [int(p[2][0]) for p in pieces]
    for p in pieces:
      assert np.array_equal(p[2], p[2][0] + np.arange(len(p[2])))
    if mode == "restart":
      assert all(f == 0 for f in firsts)
    else:
      assert all(f % S == 0 for f in firsts) and max(firsts) >= 2 * S


def test_same_seed_same_batches_other_seed_differs(corpus):
  config, _ = corpus
  config = DataConfig(**{**config.__dict__, "num_epochs": None})

  def take(seed, n=4):
    it = make_iterator(config, seq_len=S, batch_size=2, seed=seed, process_index=0, process_count=1)
    return [next(it) for _ in range(n)]

  a, b, c = take(0), take(0), take(7)
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert any(not np.array_equal(x["inputs"], z["inputs"]) for x, z in zip(a, c))


@pytest.mark.parametrize(
  "packing,sources",
  [("first_fit", ("text",)), ("concat_split", ("text",)), ("first_fit", ("text", "copy"))],
)
def test_resume_after_k_gives_identical_batches(corpus, packing, sources):
  config, _ = corpus
  config = DataConfig(
    **{
      **config.__dict__,
      "num_epochs": None,
      "packing": packing,
      "sources": sources,
      "weights": (0.6, 0.4)[: len(sources)],
    }
  )
  kwargs = dict(batch_size=2, seq_len=S, seed=3, process_index=0, process_count=1)
  it = make_iterator(config, **kwargs)
  for _ in range(5):  # several passes over the 10 train docs: epochs roll over
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # must survive JSON
  expected = [next(it) for _ in range(6)]
  resumed = make_iterator(config, **kwargs)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_two_processes_disjoint_and_covering(corpus):
  config, _ = corpus
  seen = []
  for pi in range(2):
    pieces = _pieces(
      _all_batches(
        make_iterator(config, seq_len=S, batch_size=1, seed=0, process_index=pi, process_count=2)
      )
    )
    tok = ByteTokenizer()
    seen.append({tok.decode(p[0][:7]) for p in pieces if p[2][0] == 0})
  assert seen[0] and seen[1] and not seen[0] & seen[1]
  # Together they read what one process reads in global batches of 2 rows: the
  # epoch's last partial global batch is dropped (make_iterator's docstring), so
  # which documents that row held depends on the record order, which TFDS
  # derives from the file paths (a temp dir here).
  one = _pieces(
    _all_batches(
      make_iterator(config, seq_len=S, batch_size=2, seed=0, process_index=0, process_count=1)
    )
  )
  tok = ByteTokenizer()
  assert seen[0] | seen[1] == {tok.decode(p[0][:7]) for p in one if p[2][0] == 0}
  # and nothing but that one row of S tokens is lost: at most the documents it starts.
  want = {d[:6].decode() for d in _train_docs(config)}
  assert seen[0] | seen[1] <= want and len(want - (seen[0] | seen[1])) <= S // 11


def test_invalid_utf8_flows_through_and_decodes(corpus):
  config, docs = corpus
  broken = [raw for raw in docs.values() if b"\xff\xfe" in raw][0]
  tok = ByteTokenizer()
  batches = _all_batches(
    make_iterator(
      DataConfig(**{**config.__dict__, "validation_fraction": 0.0}),
      batch_size=1,
      seq_len=S,
      seed=0,
      process_index=0,
      process_count=1,
    )
  )
  text = "".join(tok.decode(b["inputs"][0]) for b in batches)
  assert broken[:6].decode() in text and "\ufffd broken" in text


def test_copy_task_only_source_and_loss_mask():
  config = DataConfig(sources=("copy",), window_shuffle_size=1)
  tok = ByteTokenizer()
  b = next(
    make_iterator(config, batch_size=4, seq_len=256, seed=0, process_index=0, process_count=1)
  )
  assert b["inputs"].shape == (4, 256)
  checked = 0
  for r in range(4):
    for s in np.unique(b["segment_ids"][r][b["segment_ids"][r] > 0]):
      idx = b["segment_ids"][r] == s
      text = tok.decode(b["inputs"][r][idx])
      graded = b["targets"][r][idx][b["loss_mask"][r][idx] > 0]
      key = text.split("key: ")[1].split("\n")[0]
      assert graded[-1] == tok.eos_id and tok.decode(graded) == key + "\n"
      assert text.startswith("key: ") and text.endswith("\ncopy: " + key + "\n")
      checked += 1
  assert checked >= 4
  val = next(
    make_iterator(
      config,
      seq_len=256,
      split="validation",
      batch_size=4,
      seed=0,
      process_index=0,
      process_count=1,
    )
  )
  assert not np.array_equal(val["inputs"], b["inputs"])  # held-out keys differ


def test_synthetic_length_ramp_caps_early_documents():
  """The curriculum: document i is at most start + (seq_len - start) * i / n tokens."""

  def segment_lengths(**ramp):
    config = DataConfig(sources=("copy",), window_shuffle_size=1, num_packing_bins=1, **ramp)
    it = make_iterator(config, batch_size=4, seq_len=256, seed=0, process_index=0, process_count=1)
    lengths = []
    for _ in range(6):
      for row in next(it)["segment_ids"]:
        ids, counts = np.unique(row[row > 0], return_counts=True)
        lengths += counts[np.argsort(ids)].tolist()  # segment ids follow packing order
    return lengths

  ramped = segment_lengths(synthetic_ramp_documents=40, synthetic_ramp_start=96)
  assert max(ramped[:10]) <= 96 + 160 * 9 // 40  # the cap of document 9
  assert max(ramped[20:]) > 132  # longer as the cap rises
  plain = segment_lengths()
  assert max(plain[:10]) > 132  # no ramp: long from the start
  assert ramped == segment_lengths(synthetic_ramp_documents=40, synthetic_ramp_start=96)
  with pytest.raises(ValueError, match="synthetic_ramp_start >= 79"):
    make_iterator(
      DataConfig(sources=("copy",), synthetic_ramp_documents=10, synthetic_ramp_start=64),
      batch_size=1,
      seq_len=128,
      seed=0,
      process_index=0,
      process_count=1,
    )


def test_mixture_weights_and_batch_transform(corpus):
  config, _ = corpus
  config = DataConfig(
    **{**config.__dict__, "num_epochs": None, "sources": ("text", "copy"), "weights": (1.0, 3.0)}
  )
  flip = lambda batch: {k: v[:, ::-1] for k, v in batch.items()}  # noqa: E731
  plain = make_iterator(config, seq_len=S, batch_size=4, seed=0, process_index=0, process_count=1)
  flipped = make_iterator(
    config, seq_len=S, batch_size=4, seed=0, process_index=0, process_count=1, batch_transform=flip
  )
  for _ in range(5):
    a, b = next(plain), next(flipped)
    np.testing.assert_array_equal(a["inputs"][:, ::-1], b["inputs"])

  def copy_share(weights):
    # Fraction of document starts that are copy-task documents ("key: ...").
    it = make_iterator(
      dataclasses.replace(config, weights=weights),
      seq_len=S,
      batch_size=4,
      seed=0,
      process_index=0,
      process_count=1,
    )
    starts = [p for p in _pieces([next(it) for _ in range(10)]) if p[2][0] == 0]
    copies = sum(1 for p in starts if bytes((p[0][1:6] - 3).astype(np.uint8)) == b"key: ")
    return copies / len(starts)

  # Weights are token shares: 3:1 for copy must give far more copy documents
  # than 1:3 (copy documents are shorter than the cut text's windows, so both
  # shares of document starts lean to copy: measured 0.91 and 0.55 here).
  more, fewer = copy_share((1.0, 3.0)), copy_share((3.0, 1.0))
  assert more - fewer > 0.25, (more, fewer)


def test_config_errors_are_clear():
  with pytest.raises(ValueError, match="unknown data source"):
    DataConfig(sources=("books",))
  with pytest.raises(ValueError, match="weights has 1 entries for 2 sources"):
    DataConfig(sources=("text", "copy"), weights=(1.0,))
  with pytest.raises(ValueError, match="packing must be"):
    DataConfig(packing="best")
  with pytest.raises(
    ValueError, match="copy task needs seq_len >= 79 for copy_max_key_len=32; got seq_len=64"
  ):
    make_iterator(
      DataConfig(sources=("copy",)),
      batch_size=1,
      seq_len=64,
      seed=0,
      process_index=0,
      process_count=1,
    )
  with pytest.raises(ValueError, match="process_index=2"):
    make_iterator(
      DataConfig(sources=("copy",)),
      batch_size=1,
      seq_len=128,
      seed=0,
      process_index=2,
      process_count=2,
    )


def test_inspect_data_report(corpus):
  config, _ = corpus
  config = DataConfig(**{**config.__dict__, "num_epochs": None})
  report = inspect_data(config, batch_size=16, seq_len=S)
  fill = [l for l in report.splitlines() if l.startswith("fill_ratio: ")]
  assert len(fill) == 1
  ratio, half_width = float(fill[0].split()[1]), float(fill[0].split()[2][3:-1])
  n = int(re.search(r"batches: (\d+) x", report).group(1))
  # Read until the ratio is known to +-0.005 (95%), and it is the ratio of those batches.
  assert half_width <= 0.005 and n >= 16
  it = make_iterator(config, seq_len=S, batch_size=16, seed=0, process_index=0, process_count=1)
  want = np.mean([(next(it)["segment_ids"] > 0).mean() for _ in range(n)])
  assert abs(ratio - want) < 1e-4
  assert "documents_per_row" in report and "‖[seg 1 @pos" in report
  assert "document_length[text]" in report


def test_load_documents_for_evals(corpus):
  from lctx.data import load_documents, make_tokenizer_for

  config, docs = corpus
  assert make_tokenizer_for(config).vocab_size == 259
  got = load_documents(config, split="train", limit=3)
  assert len(got) == 3 and len(set(got)) == 3
  texts = {raw.decode("utf-8", "replace") for raw in docs.values()}
  assert set(got) <= texts
  # Fewer train docs than 8 x limit candidates: exactly the 3 longest come back.
  train = sorted((r.decode("utf-8", "replace") for r in _train_docs(config)), key=len)
  assert sorted(got, key=len) == train[-3:]
  assert load_documents(DataConfig(sources=("copy",))) is None
