"""Conversation sources through the grain pipeline: whole conversations in rows,
mixed by tokens with text, chat_overflow counted, bad rows named by file:line."""

import json

import helpers
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lctx.data import chat, conversations, files
from lctx.data.inspect import inspect_data
from lctx.data.pipeline import DataConfig, make_iterator


def _conversation(i: int) -> list[dict]:
  rng = np.random.default_rng(i)
  words = ["alpha", "beta", "gamma", "key", "document"]
  doc = " ".join(rng.choice(words, int(rng.integers(5, 40))))
  turns = [{"role": "user", "content": f"document {i}: {doc}\nwhat is the key?"}]
  for t in range(int(rng.integers(1, 4))):
    turns.append(
      {"role": "assistant", "content": f"answer {i}.{t} " + " ".join(rng.choice(words, 3))}
    )
    turns.append({"role": "user", "content": "and then?"})
  return turns[:-1]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return helpers.save_chat_tokenizer(str(tmp_path_factory.mktemp("tok") / "chatml"), "chatml")


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return str(path)


def _config(tmp_path, tok, sources, **kw):
  return DataConfig(
    sources=sources,
    tokenizer="hf",
    tokenizer_model_path=tok,
    data_dir=str(tmp_path / "cache"),
    validation_fraction=0.0,
    num_packing_bins=8,
    window_shuffle_size=1,
    **kw,
  )


def _segments(batch):
  """(source id, inputs, targets, positions, loss_mask) of every segment in the batch."""
  out = []
  for r in range(batch["segment_ids"].shape[0]):
    seg = batch["segment_ids"][r]
    for s in np.unique(seg[seg > 0]):
      idx = np.flatnonzero(seg == s)
      assert (np.diff(idx) == 1).all()
      out.append(
        tuple(
          batch[k][r, idx] for k in ("source_ids", "inputs", "targets", "positions", "loss_mask")
        )
      )
  return out


def test_conversations_whole_in_rows_and_mixed_by_tokens(tmp_path, tok):
  convs = [_conversation(i) for i in range(24)]
  jsonl = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs[:12]])
  pairs = [{"q": m[0]["content"], "a": m[1]["content"], "sys": "be brief"} for m in convs[12:]]
  pq.write_table(pa.Table.from_pylist(pairs), str(tmp_path / "pairs.parquet"))
  text_dir = tmp_path / "text"
  text_dir.mkdir()
  (text_dir / "a.txt").write_text("plain text document " * 40)
  sources = (
    {"kind": "chat", "path": jsonl, "field": "messages", "weight": 1.0, "name": "conv"},
    {
      "kind": "chat",
      "path": str(tmp_path / "pairs.parquet"),
      "prompt_field": "q",
      "completion_field": "a",
      "system_field": "sys",
      "name": "pairs",
    },
    {"kind": "text", "path": str(text_dir), "weight": 1.0},
  )
  config = _config(tmp_path, tok, sources)
  expected = {}
  for m in convs[:12]:
    ids, mask = chat.encode_chat(m, tok)
    expected[tuple(ids[:-1].tolist())] = (ids, mask)
  for m in convs[12:]:
    msgs = [{"role": "system", "content": "be brief"}] + m[:2]
    ids, mask = chat.encode_chat(msgs, tok)
    expected[tuple(ids[:-1].tolist())] = (ids, mask)
  it = make_iterator(
    config, batch_size=4, seq_len=256, seed=0, process_index=0, process_count=1, with_sources=True
  )
  seen_sources, seen = set(), 0
  for _ in range(6):
    for source, inputs, targets, positions, mask in _segments(next(it)):
      seen_sources.add(int(source[0]))
      if int(source[0]) == 3:  # text
        continue
      ids, full_mask = expected[tuple(inputs.tolist())]  # a whole conversation, never a part
      assert targets.tolist() == ids[1:].tolist()
      assert positions.tolist() == list(range(len(inputs)))
      assert mask.tolist() == full_mask[1:].tolist()
      seen += 1
  assert seen_sources == {1, 2, 3} and seen > 10


def test_chat_overflow_drop_and_split_counted(tmp_path, tok):
  convs = [_conversation(i) for i in range(16)]
  jsonl = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
  lengths = [len(chat.encode_chat(m, tok)[0]) for m in convs]
  seq_len = int(np.median(lengths))
  too_long = sum(n > seq_len + 1 for n in lengths)
  assert 0 < too_long < len(convs)
  records = {}
  for overflow in ("drop", "split_turns"):
    config = _config(
      tmp_path, tok, ({"kind": "chat", "path": jsonl, "field": "messages"},), chat_overflow=overflow
    )
    path = tmp_path / f"inspect_{overflow}.json"
    inspect_data(config, num_batches=2, batch_size=2, seq_len=seq_len, json_path=str(path))
    records[overflow] = json.loads(path.read_text())
    it = make_iterator(
      config, batch_size=2, seq_len=seq_len, seed=0, process_count=1, process_index=0
    )
    for _ in range(4):
      b = next(it)
      assert b["loss_mask"].sum() > 0
  pieces = [
    conversations.fit_pieces(chat.encode_conversation(m, tok), seq_len, "split_turns")[1]
    for m in convs
  ]
  assert records["drop"]["chat_dropped"] == too_long and records["drop"]["chat_split"] == 0
  assert records["split_turns"]["chat_split"] == pieces.count("split") > 0
  assert records["split_turns"]["chat_dropped"] == pieces.count("dropped")
  assert records["drop"]["chat_conversations"] == len(convs)


@pytest.mark.parametrize(
  "row, match",
  [
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, "has no 'content'"),
    ({"text": "x"}, "has no field 'messages'"),
    ({"messages": [{"role": "user", "content": "x"}], "system": 3}, "not text"),
  ],
)
def test_bad_rows_name_file_and_line(tmp_path, tok, row, match):
  good = {"messages": _conversation(0)}
  path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, row])
  config = _config(tmp_path, tok, ({"kind": "chat", "path": path, "field": "messages"},))
  with pytest.raises(files.BadRowError, match=rf"bad\.jsonl:3: .*{match}"):
    next(make_iterator(config, batch_size=2, seq_len=256, seed=0, process_count=1, process_index=0))


def test_template_failure_names_file_and_line(tmp_path, tok):
  fail = "{% if messages|length > 2 %}{{ raise_exception('too many turns') }}{% endif %}x"
  rows = [{"messages": _conversation(i)[:2]} for i in range(3)] + [{"messages": _conversation(9)}]
  rows[-1]["messages"] = rows[-1]["messages"][:2] + [{"role": "user", "content": "more"}]
  path = _write_jsonl(tmp_path / "conv.jsonl", rows)
  source = {"kind": "chat", "path": path, "field": "messages", "chat_template": fail}
  config = _config(tmp_path, tok, (source,), num_epochs=1)
  with pytest.raises(files.BadRowError, match=r"conv\.jsonl:4: the chat template failed: too many"):
    list(make_iterator(config, batch_size=1, seq_len=256, seed=0, process_count=1, process_index=0))


def test_chat_config_errors(tmp_path, tok):
  chat_source = {"kind": "chat", "path": "x.jsonl", "field": "messages"}
  with pytest.raises(ValueError, match="tokenizer='hf'"):
    DataConfig(sources=(chat_source,))
  with pytest.raises(ValueError, match="packing='first_fit'"):
    _config(tmp_path, tok, (chat_source,), packing="concat_split")
  with pytest.raises(ValueError, match="chat_overflow"):
    _config(tmp_path, tok, (chat_source,), chat_overflow="truncate")
  with pytest.raises(ValueError, match="either 'field'"):
    _config(tmp_path, tok, (dict(chat_source, prompt_field="q"),))
  with pytest.raises(ValueError, match="do not apply to conversations"):
    _config(tmp_path, tok, (dict(chat_source, max_tokens=10),))
  with pytest.raises(ValueError, match="apply only to kind 'chat'"):
    _config(tmp_path, tok, ({"kind": "jsonl", "path": "x", "field": "t", "train_on": "all"},))
