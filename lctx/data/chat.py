"""Conversations -> token ids and a loss mask, through the model's own chat template.

    ids, loss_mask = encode_chat(messages, "/ckpt/llama31", train_on="assistant")
    text = render_chat(messages, "/ckpt/llama31", add_generation_prompt=True)

messages: the OpenAI / Hugging Face chat form, [{'role': 'system' | 'user' |
'assistant' | 'tool' | 'ipython', 'content': str}, ...]. model_path: a
directory holding tokenizer.json and the template (chat_template.jinja, else
tokenizer_config.json's `chat_template`), or the tokenizer.json file.

ids int32 [L] and loss_mask float32 [L]: loss_mask[j] = 1 when token j is a
target the loss counts (the pipeline's `target_mask`, lctx/data/packing.py).

Rendering is jinja2 set up as transformers' `apply_chat_template` sets it up (a
sandboxed environment with trim_blocks / lstrip_blocks, loopcontrols, the
`{% generation %}` tag, `raise_exception`, `strftime_now`, `tojson`, `dict`,
`namespace`; the special tokens of tokenizer_config.json as variables), and
the text is tokenized by tokenizer.json with no special tokens added, as
transformers does. Why not call transformers at runtime: it is a large import
for ~60 lines of jinja2 set-up around the same `tokenizers` library lctx
already uses, and it stays the outside reference the tests compare with
(tests/test_data_chat.py), which a runtime call would compare with itself.

The assistant mask:
- a template with `{% generation %}` markers: the tokens overlapping a marked
  span, exactly transformers' `return_assistant_tokens_mask`;
- a template without them (Llama 3.1's, Qwen3's): prefix differences. Turn i's
  tokens are render(messages[:i+1]) minus render(messages[:i],
  add_generation_prompt=True): the turn's text and its end-of-turn tokens
  (`<|eot_id|>`, `<|im_end|>\\n`), up to the next turn's header. Next to a
  marked template that puts only the content inside the markers, this adds
  each turn's end token (the model must learn to stop) and the whitespace after it.
  A template that renders an earlier assistant turn differently once later
  turns follow (Qwen3 drops the reasoning of turns before the last user
  message) has no such prefixes: encode_chat raises ChatError saying so; use a
  template with `{% generation %}` markers (the 'chat_template' of a chat
  source) or train_on='all'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import datetime

import numpy as np

ROLES = ("system", "user", "assistant", "tool", "ipython")
TRAIN_ON = ("assistant", "all")
_SPECIAL_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class ChatError(ValueError):
  """A conversation the template or the mask cannot handle (the message says why)."""


# -- the template environment (as transformers.utils.chat_template_utils) ------
_SPANS: ContextVar[list | None] = ContextVar("lctx_generation_spans", default=None)


def _environment():
  import jinja2  # pylint: disable=g-import-not-at-top  (only for chat data)
  import jinja2.ext  # pylint: disable=g-import-not-at-top
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  class GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records the (start, end)
    characters of what it renders while a tracker is active."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(
        lineno
      )

    @jinja2.pass_eval_context
    def _generation(self, context, caller):
      del context
      text = caller()
      tracking = _SPANS.get()
      if tracking is not None:
        blocks, spans = tracking
        start = len("".join(blocks))
        spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  class TemplateDict:
    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # noqa: N805  (jinja's own signature trick)
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'.")

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  env.globals["dict"] = TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  return env


@dataclasses.dataclass(frozen=True)
class ChatModel:
  """A model's chat template (compiled) and tokenizer."""

  template_text: str
  template: object  # jinja2.Template
  variables: dict  # bos_token, eos_token ... as strings
  tokenizer: object  # lctx.data.tokenizers.HFTokenizer

  @property
  def has_generation_markers(self) -> bool:
    return bool(_GENERATION_TAG.search(self.template_text))


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _template_text(directory: str, chat_template: str | None) -> str:
  if chat_template is not None:
    if os.path.isdir(os.path.expanduser(chat_template)):  # another model's template
      return _template_text(os.path.expanduser(chat_template), None)
    if os.path.isfile(os.path.expanduser(chat_template)):
      with open(os.path.expanduser(chat_template), encoding="utf-8") as f:
        return f.read()
    if "{" not in chat_template:
      raise ChatError(
        f"chat_template {chat_template!r} is neither a directory, a file nor template text."
      )
    return chat_template
  jinja_file = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  found = _read_json(os.path.join(directory, "tokenizer_config.json")).get("chat_template")
  if isinstance(found, list):  # [{'name': 'default', 'template': ...}, ...]
    found = {t.get("name"): t.get("template") for t in found}.get("default")
  if not isinstance(found, str):
    raise ChatError(
      f"no chat template for {directory}: neither chat_template.jinja nor a 'chat_template' "
      "in tokenizer_config.json; pass chat_template (a .jinja file or the template text)."
    )
  return found


@functools.lru_cache(maxsize=16)
def load_chat_model(model_path: str, chat_template: str | None = None) -> ChatModel:
  """The template and tokenizer of model_path (cached per path).

  chat_template: instead of the model's, the template of another model
  directory (e.g. the instruct model of a base checkpoint), a .jinja file, or
  template text."""
  from lctx.data.tokenizers import HFTokenizer  # pylint: disable=g-import-not-at-top

  path = os.path.expanduser(model_path)
  directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  text = _template_text(directory, chat_template)
  import jinja2  # pylint: disable=g-import-not-at-top

  try:
    template = _environment().from_string(text)
  except jinja2.exceptions.TemplateError as e:
    raise ChatError(f"the chat template of {directory} does not compile: {e}") from e
  variables = {}
  for name in ("tokenizer_config.json", "special_tokens_map.json"):
    for kind in _SPECIAL_TOKENS:
      token = _read_json(os.path.join(directory, name)).get(f"{kind}_token")
      if isinstance(token, dict):
        token = token.get("content")
      if isinstance(token, str):
        variables.setdefault(f"{kind}_token", token)
  return ChatModel(text, template, variables, HFTokenizer(path))


# -- rendering -------------------------------------------------------------------
def _normalize(messages: Sequence[dict]) -> list[dict]:
  """As transformers: None-valued keys dropped, reasoning under every alias."""
  out = []
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise ChatError(f"message {i} is {type(message).__name__}, not a dict.")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


def _render(model: ChatModel, messages, add_generation_prompt: bool, spans=None, **kwargs) -> str:
  import jinja2  # pylint: disable=g-import-not-at-top

  variables = {**model.variables, **kwargs}
  args = dict(
    messages=_normalize(messages),
    tools=None,
    documents=None,
    add_generation_prompt=add_generation_prompt,
    **variables,
  )
  try:
    if spans is None:
      return model.template.render(**args)
    blocks = []
    token = _SPANS.set((blocks, spans))
    try:
      for block in model.template.generate(**args):
        blocks.append(block)
    finally:
      _SPANS.reset(token)
    return "".join(blocks)
  except jinja2.exceptions.TemplateError as e:
    raise ChatError(f"the chat template failed: {e}") from e
  except (TypeError, KeyError, AttributeError, IndexError) as e:
    raise ChatError(f"the chat template failed ({type(e).__name__}: {e}).") from e


def render_chat(
  messages: Sequence[dict],
  model_path: str,
  *,
  add_generation_prompt: bool = False,
  chat_template: str | None = None,
  **template_kwargs,
) -> str:
  """The templated text of `messages`, as transformers'
  apply_chat_template(messages, tokenize=False, ...) gives it.

  add_generation_prompt: end with the header of an assistant turn (for
  generation, e.g. an eval prompt). template_kwargs: extra template variables
  (enable_thinking=False, date_string=...)."""
  check_messages(messages)
  model = load_chat_model(model_path, chat_template)
  return _render(model, messages, add_generation_prompt, **template_kwargs)


def check_messages(messages) -> None:
  """ChatError unless messages is a non-empty list of {'role', 'content'} dicts
  with known roles."""
  if not isinstance(messages, list | tuple) or not messages:
    raise ChatError(f"messages must be a non-empty list of dicts, got {type(messages).__name__}.")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise ChatError(f"message {i} is {type(m).__name__}, not a dict with 'role' and 'content'.")
    if "role" not in m:
      raise ChatError(f"message {i} has no 'role' (it has {sorted(m)}).")
    if m["role"] not in ROLES:
      raise ChatError(f"message {i} has unknown role {m['role']!r}; roles are {ROLES}.")
    if "content" not in m and not m.get("tool_calls"):
      raise ChatError(f"message {i} ({m['role']}) has no 'content'.")


# -- tokens and masks ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Conversation:
  """ids int32 [L]; loss_mask float32 [L]; turn_starts int32 [M]: the token
  index where each message's text begins, or -1 where no token boundary falls
  there (a place where split_turns may not cut)."""

  ids: np.ndarray
  loss_mask: np.ndarray
  turn_starts: np.ndarray


def _char_mask(offsets, spans) -> np.ndarray:
  """1 for every token overlapping a (start, end) character span (transformers' rule)."""
  mask = np.zeros(len(offsets), np.float32)
  k = 0
  for j, (start, end) in enumerate(offsets):
    while k < len(spans) and start >= spans[k][1]:
      k += 1
    if k == len(spans):
      break
    if end > spans[k][0]:
      mask[j] = 1.0
  return mask


def _token_at(offsets, char: int) -> int:
  """Index of the first token starting at `char`; -1 if a token straddles it."""
  for j, (start, end) in enumerate(offsets):
    if start >= char:
      return j
    if end > char:
      return -1
  return len(offsets)


def _prefix(model: ChatModel, messages, k: int, full: str, generation_prompt: bool, cache) -> int:
  """Characters of render(messages[:k]) (a prefix of `full`, else ChatError)."""
  if (k, generation_prompt) not in cache:
    cache[k, generation_prompt] = _render(model, messages[:k], generation_prompt) if k else ""
  text = cache[k, generation_prompt]
  if not full.startswith(text):
    raise ChatError(
      f"the chat template renders the conversation's first {k} message(s) differently once "
      "later turns follow (it rewrites earlier turns, as Qwen3's drops earlier reasoning), so "
      "the assistant tokens cannot be found by prefix; use a template with {% generation %} "
      "markers (a chat source's 'chat_template') or train_on='all'."
    )
  return len(text)


def encode_conversation(
  messages: Sequence[dict],
  model_path: str,
  train_on: str = "assistant",
  *,
  chat_template: str | None = None,
  turn_starts: bool = True,
) -> Conversation:
  """encode_chat, plus where each message begins (for splitting at turns)."""
  if train_on not in TRAIN_ON:
    raise ChatError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}.")
  check_messages(messages)
  model = load_chat_model(model_path, chat_template)
  spans = [] if model.has_generation_markers and train_on == "assistant" else None
  full = _render(model, messages, False, spans=spans)
  cache = {}  # (k, add_generation_prompt) -> render(messages[:k])
  ids, offsets = model.tokenizer.encode_with_offsets(full)
  if train_on == "all":
    mask = np.ones(len(ids), np.float32)
  elif spans is not None:
    mask = _char_mask(offsets, spans)
  else:
    char_spans = []
    for i, m in enumerate(messages):
      if m["role"] == "assistant":
        start = _prefix(model, messages, i, full, True, cache)
        char_spans.append((start, _prefix(model, messages, i + 1, full, False, cache)))
    mask = _char_mask(offsets, char_spans)
  starts = np.full(len(messages), -1, np.int32)
  if turn_starts:
    for k in range(len(messages)):
      with contextlib.suppress(ChatError):  # not a prefix: no cut there
        starts[k] = _token_at(offsets, _prefix(model, messages, k, full, False, cache))
  return Conversation(np.asarray(ids, np.int32), mask, starts)


def encode_chat(
  messages: Sequence[dict],
  model_path: str,
  train_on: str = "assistant",
  *,
  chat_template: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [L], loss_mask float32 [L]) of one conversation.

  train_on: 'assistant' (the assistant turns, see the module docstring) or
  'all' (every token). Raises ChatError (a ValueError) for a bad message list,
  a template that fails, or a mask the template does not allow."""
  conv = encode_conversation(
    messages, model_path, train_on, chat_template=chat_template, turn_starts=False
  )
  return conv.ids, conv.loss_mask
