"""lctx.data.chat against transformers' apply_chat_template on the published chat
templates of Llama 3.1 and Qwen3 and on ChatML, with tiny tokenizers built here."""

import helpers
import numpy as np
import pytest

from lctx.data import chat, conversations

SYSTEM_AND_TURNS = [
  {"role": "system", "content": "  You read documents. Answer with the key. "},
  {"role": "user", "content": "document: alpha beta key=gamma über\nwhat is the key?"},
  {"role": "assistant", "content": "the answer is gamma"},
  {"role": "user", "content": "and the first word?"},
  {"role": "assistant", "content": " alpha \n"},
  {"role": "user", "content": "thanks"},
  {"role": "assistant", "content": "the end"},
]
ONE_TURN = [
  {"role": "user", "content": "what is the key? key=beta"},
  {"role": "assistant", "content": "beta"},
]
NO_SYSTEM = SYSTEM_AND_TURNS[1:]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat_tokenizers")
  return {f: helpers.save_chat_tokenizer(str(root / f), f) for f in helpers.CHAT_FAMILIES}


def _reference(path):
  import transformers

  return transformers.AutoTokenizer.from_pretrained(path)


def _decode(path, ids):
  return _reference(path).decode(list(ids), skip_special_tokens=False)


@pytest.mark.parametrize("family", ["llama31", "qwen3", "chatml", "chatml_generation"])
def test_ids_and_text_equal_transformers(tokenizers, family):
  path = tokenizers[family]
  ref = _reference(path)
  conversations = [SYSTEM_AND_TURNS, ONE_TURN, NO_SYSTEM]
  for messages in conversations:
    for prompt in (False, True):
      text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
      assert chat.render_chat(messages, path, add_generation_prompt=prompt) == text
    text = ref.apply_chat_template(messages, tokenize=False)
    expected = ref(text, add_special_tokens=False)["input_ids"]
    ids, mask = chat.encode_chat(messages, path, train_on="all")
    assert ids.dtype == np.int32 and mask.dtype == np.float32 and ids.shape == mask.shape
    assert ids.tolist() == expected
    assert mask.all()
  # The template's own control tokens are single special ids.
  ids, _ = chat.encode_chat(ONE_TURN, path, train_on="all")
  eos = ref.convert_tokens_to_ids(helpers.CHAT_FAMILIES[family]["eos"])
  assert eos in ids.tolist()


def test_qwen3_template_variables_pass_through(tokenizers):
  path = tokenizers["qwen3"]
  ref = _reference(path)
  text = ref.apply_chat_template(
    ONE_TURN[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False
  )
  assert text.endswith("<think>\n\n</think>\n\n")
  assert (
    chat.render_chat(ONE_TURN[:1], path, add_generation_prompt=True, enable_thinking=False) == text
  )


def test_generation_marker_mask_equals_transformers(tokenizers):
  path = tokenizers["chatml_generation"]
  ref = _reference(path)
  for messages in (SYSTEM_AND_TURNS, ONE_TURN):
    out = ref.apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = chat.encode_chat(messages, path)
    assert ids.tolist() == list(out["input_ids"])
    assert mask.tolist() == [float(x) for x in out["assistant_masks"]]
    assert mask.sum() > 0


def test_prefix_mask_is_the_marker_mask_plus_each_turns_end(tokenizers):
  """ChatML without markers (prefix differences) against ChatML with markers
  around the content: the same ids; the prefix mask holds the marked tokens
  plus, per assistant turn, its <|im_end|> and the newline after it."""
  marked, plain = tokenizers["chatml_generation"], tokenizers["chatml"]
  for messages in (SYSTEM_AND_TURNS, ONE_TURN):
    ids_m, mask_m = chat.encode_chat(messages, marked)
    ids_p, mask_p = chat.encode_chat(messages, plain)
    assert ids_m.tolist() == ids_p.tolist()
    assert np.all(mask_p >= mask_m)
    extra = [int(i) for i in ids_p[(mask_p > 0) & (mask_m == 0)]]
    turns = sum(m["role"] == "assistant" for m in messages)
    assert _decode(plain, extra) == "<|im_end|>\n" * turns


def test_llama31_prefix_mask_is_each_answer_and_its_eot(tokenizers):
  path = tokenizers["llama31"]
  ids, mask = chat.encode_chat(SYSTEM_AND_TURNS, path)
  assert mask[0] == 0  # BOS
  # The masked runs, decoded, are each assistant turn (trimmed, as the template
  # does) and its <|eot_id|>.
  runs, run = [], []
  for i, m in zip(ids, mask):
    if m:
      run.append(int(i))
    elif run:
      runs.append(run)
      run = []
  runs += [run] if run else []
  answers = [m["content"].strip() for m in SYSTEM_AND_TURNS if m["role"] == "assistant"]
  assert [_decode(path, r) for r in runs] == [a + "<|eot_id|>" for a in answers]


def test_qwen3_one_turn_mask_and_multi_turn_refusal(tokenizers):
  path = tokenizers["qwen3"]
  ids, mask = chat.encode_chat(ONE_TURN, path)
  supervised = _decode(path, ids[mask > 0])
  # The last turn after the last user message carries the (empty) think block.
  assert supervised == "<think>\n\n</think>\n\nbeta<|im_end|>\n"
  # Earlier assistant turns lose their think block once later turns follow:
  # no prefix exists, and the error says what to do.
  with pytest.raises(chat.ChatError, match="rewrites earlier turns.*generation"):
    chat.encode_chat(SYSTEM_AND_TURNS, path)
  ids_all, mask_all = chat.encode_chat(SYSTEM_AND_TURNS, path, train_on="all")
  assert mask_all.all() and len(ids_all)
  # A template with markers given instead of the model's handles the multi-turn row.
  ids_g, mask_g = chat.encode_chat(SYSTEM_AND_TURNS, path, chat_template=helpers.CHATML_GENERATION)
  assert 0 < mask_g.sum() < len(mask_g)


@pytest.mark.parametrize(
  "messages, match",
  [
    ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
    ([{"role": "user"}], "has no 'content'"),
    ([{"content": "x"}], "has no 'role'"),
    ([], "non-empty list"),
    ("hello", "non-empty list"),
  ],
)
def test_bad_messages_raise(tokenizers, messages, match):
  with pytest.raises(chat.ChatError, match=match):
    chat.encode_chat(messages, tokenizers["chatml"])


def test_template_failure_is_a_chat_error(tokenizers):
  two_calls = [
    {"role": "user", "content": "x"},
    {
      "role": "assistant",
      "tool_calls": [
        {"function": {"name": "a", "arguments": {}}},
        {"function": {"name": "b", "arguments": {}}},
      ],
    },
  ]
  with pytest.raises(chat.ChatError, match="only supports single tool-calls"):
    chat.encode_chat(two_calls, tokenizers["llama31"])
  assert issubclass(chat.ChatError, ValueError)
  with pytest.raises(chat.ChatError, match="train_on"):
    chat.encode_chat(ONE_TURN, tokenizers["chatml"], train_on="user")


def test_fit_pieces_split_at_turns(tokenizers):
  path = tokenizers["chatml"]
  conv = chat.encode_conversation(SYSTEM_AND_TURNS, path)
  n = len(conv.ids)
  assert (conv.turn_starts >= 0).all() and conv.turn_starts[0] == 0
  pieces, outcome = conversations.fit_pieces(conv, n - 1, "split_turns")
  assert outcome == "fit" and pieces[0] is conv
  assert conversations.fit_pieces(conv, n - 2, "drop") == ([], "dropped")
  seq_len = n // 2
  pieces, outcome = conversations.fit_pieces(conv, seq_len, "split_turns")
  assert outcome == "split" and len(pieces) >= 2
  starts = set(conv.turn_starts.tolist())
  at = 0
  for p in pieces:
    assert len(p.ids) <= seq_len + 1 and p.loss_mask[1:].any()
    at = next(
      s
      for s in sorted(starts)
      if s >= at and conv.ids[s : s + len(p.ids)].tolist() == p.ids.tolist()
    )
    assert at in starts  # every piece begins at a message start
    assert p.loss_mask.tolist() == conv.loss_mask[at : at + len(p.ids)].tolist()
    at += len(p.ids)
  # A single message longer than a row: dropped.
  assert conversations.fit_pieces(conv, 4, "split_turns") == ([], "dropped")


def test_chat_template_from_another_model_directory(tokenizers, tmp_path):
  """A base checkpoint without a template borrows the instruct model's."""
  import shutil

  base = tmp_path / "base"
  shutil.copytree(tokenizers["llama31"], base)
  (base / "chat_template.jinja").unlink()
  config = base / "tokenizer_config.json"
  config.write_text(config.read_text().replace('"chat_template"', '"unused"'))
  with pytest.raises(chat.ChatError, match="no chat template"):
    chat.encode_chat(ONE_TURN, str(base))
  got = chat.encode_chat(ONE_TURN, str(base), chat_template=tokenizers["llama31"])
  want = chat.encode_chat(ONE_TURN, tokenizers["llama31"])
  assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
