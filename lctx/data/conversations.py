"""Conversation rows of files, as the pipeline stores and encodes them, and
what happens to a conversation longer than a row (DataConfig.chat_overflow).

The templates and masks themselves: lctx/data/chat.py.
"""

from __future__ import annotations

import json

import numpy as np

from lctx.data.chat import ChatError, Conversation, check_messages, encode_conversation
from lctx.errors import BadRowError

# -- too-long conversations -------------------------------------------------------
OVERFLOW = ("drop", "split_turns")


def fit_pieces(conv: Conversation, seq_len: int, overflow: str) -> tuple[list[Conversation], str]:
  """A conversation -> the pieces that go into rows of seq_len examples, and
  what happened: 'fit' (one piece, the whole conversation), 'split' (several,
  cut at message starts) or 'dropped' (none).

  A piece of n tokens gives n - 1 examples, so it fits when n <= seq_len + 1.
  split_turns cuts greedily at the latest message start that keeps a piece
  within that; a message that alone does not fit drops the conversation.
  Pieces without a supervised target are left out.
  """
  if overflow not in OVERFLOW:
    raise ChatError(f"chat_overflow must be one of {OVERFLOW}, got {overflow!r}.")
  n = len(conv.ids)
  limit = seq_len + 1
  if n <= limit:
    return [conv], "fit"
  if overflow == "drop":
    return [], "dropped"
  cuts = sorted({int(s) for s in conv.turn_starts if 0 < s < n})
  bounds, start = [0], 0
  while n - start > limit:
    inside = [c for c in cuts if start < c <= start + limit]
    if not inside:
      return [], "dropped"
    start = inside[-1]
    bounds.append(start)
  bounds.append(n)
  pieces = []
  for a, b in zip(bounds[:-1], bounds[1:]):
    mask = conv.loss_mask[a:b]
    if mask[1:].any():  # token 0 of a piece is never a target
      rel = np.asarray([s - a for s in conv.turn_starts if a <= s < b], np.int32)
      pieces.append(Conversation(conv.ids[a:b], mask, rel))
  return pieces, "split" if pieces else "dropped"


# -- rows of conversation files --------------------------------------------------
def row_messages(row, fields: dict) -> list[dict]:
  """A file row -> its messages. fields (lctx.data.specs.chat_fields):
  'messages' (the column of messages) or 'prompt' and 'completion' (a user
  and an assistant turn), and 'system' (a column whose text, when the row has
  it, is prepended as the system turn). ChatError for a bad row."""
  if not isinstance(row, dict):
    raise ChatError(f"the row is {type(row).__name__}, not an object.")

  def need(field):
    if field not in row or row[field] is None:
      raise ChatError(f"the row has no field {field!r} (it has {sorted(row)[:10]}).")
    return row[field]

  if fields.get("messages"):
    messages = need(fields["messages"])
    if not isinstance(messages, list):
      raise ChatError(f"field {fields['messages']!r} is {type(messages).__name__}, not a list.")
    messages = [dict(m) if isinstance(m, dict) else m for m in messages]
  else:
    turns = []
    for role, key in (("user", "prompt"), ("assistant", "completion")):
      value = need(fields[key])
      if not isinstance(value, str):
        raise ChatError(f"field {fields[key]!r} is {type(value).__name__}, not text.")
      turns.append({"role": role, "content": value})
    messages = turns
  system = row.get(fields.get("system") or "system")
  if system is not None:
    if not isinstance(system, str):
      raise ChatError(f"field {fields['system']!r} is {type(system).__name__}, not text.")
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
      raise ChatError(f"the row has a system field {fields['system']!r} and a system message.")
    messages = [{"role": "system", "content": system}] + messages
  check_messages(messages)
  return messages


def row_to_bytes(row, where: str, fields: dict) -> bytes:
  """A file row -> the stored document: JSON of its messages and where it came
  from ('file:line', for errors raised later, e.g. by the template)."""
  try:
    messages = row_messages(row, fields)
  except ChatError as e:
    raise BadRowError(where, str(e)) from e
  return json.dumps({"where": where, "messages": messages}, ensure_ascii=False).encode("utf-8")


def encode_stored(
  raw: bytes, model_path: str, train_on: str, chat_template: str | None
) -> Conversation:
  """A stored row (row_to_bytes) -> its Conversation; a failure raises
  BadRowError naming the row's file and line."""
  row = json.loads(raw)
  try:
    return encode_conversation(row["messages"], model_path, train_on, chat_template=chat_template)
  except ChatError as e:
    raise BadRowError(row["where"], str(e)) from e
