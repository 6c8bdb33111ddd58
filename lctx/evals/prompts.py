"""RULER prompts as text, tokenized once (EvalConfig.prompts = 'ruler').

One example is one string: the task's instruction, a context, the question and
the answer prefix (lctx/evals/ruler.py), rendered by `render_prompt` and
encoded by the model's tokenizer in one call, so the ids are what real text of
that string gives. The context is a haystack of units, each a sentence or a
line that keeps its own trailing whitespace; needles go between units (a
sentence or line boundary, never inside one), each on its own line.

    [BOS] ids(render_prompt(head + context + tail, answer_prefix)) | ids(answer)
          |<------------- prompt, <= length - reserve ----------->|

Sizing: the largest haystack (units, or cwe/fwe's n) whose prompt fits
`length - BOS - reserve` tokens, reserve = max(answer tokens, decoding budget),
so a prompt plus its greedy decoding fits the grid's length. Depth is in
tokens: the needle at `depth` goes to the unit boundary whose token offset in
the context is nearest depth x (context tokens); the example records the
offset it got in the tokenized prompt (`depth_offset`). The other needles go
to seeded random boundaries (a variable chain's later hops after its first).
The needle-removed control rebuilds the same example (same seed, units and
boundaries) without the queried needles; answers are redrawn until none occurs
in that control's context.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

import numpy as np

from lctx.errors import ConfigError
from lctx.evals import ruler
from lctx.evals.haystack import ALT_NOISE_FILLER
from lctx.evals.tasks import PHRASINGS, RetrievalExample

TEXT_HAYSTACK_KINDS = ("noise", "alt_noise", "needle", "text")
RULER_NOISE = (
  "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
_BOUNDARY = re.compile(r"(?<=[.!?] )|(?<=\n)(?=[^\n])")


class TextHaystack:
  """Units of text (sentences or lines, each with its trailing whitespace).

  'noise' / 'alt_noise' repeat one sentence block a line (RULER's noise);
  'needle' is a stream of distractor needles of the task's kinds (RULER's
  needle haystack), drawn per example; 'text' is documents (the corpus's prose
  or code: RULER's essay stand-in) cut at sentence ends and line ends, read
  from a seeded random unit on, wrapping around.
  """

  def __init__(self, kind: str, units: list[str] | None = None):
    if kind not in TEXT_HAYSTACK_KINDS:
      raise ValueError(f"unknown haystack kind {kind!r}; expected one of {TEXT_HAYSTACK_KINDS}.")
    if kind == "text" and not units:
      raise ValueError("haystack 'text' got no non-empty documents.")
    self.kind, self.units = kind, units or []

  def stream(self, spec: ruler.TextSpec, rng: np.random.Generator):
    """An endless iterator of units for one example."""
    if self.kind == "needle":
      if spec.distractor is None:
        raise ValueError("the 'needle' haystack is for the niah tasks.")
      while True:
        yield spec.distractor(rng) + "\n"
    if self.kind in ("noise", "alt_noise"):
      unit = (RULER_NOISE if self.kind == "noise" else ALT_NOISE_FILLER.strip()) + "\n"
      while True:
        yield unit
    i = int(rng.integers(len(self.units)))
    while True:
      yield self.units[i % len(self.units)]
      i += 1


def make_text_haystack(
  kind: str, documents: Iterable | None = None, tokenizer=None
) -> TextHaystack:
  """A TextHaystack; 'text' needs `documents` (strings, or id arrays with `tokenizer`)."""
  if kind != "text":
    return TextHaystack(kind)
  if documents is None:
    raise ValueError("haystack 'text' needs documents (a list of strings).")
  units = []
  for doc in documents:
    text = doc if isinstance(doc, str) else tokenizer.decode(np.asarray(doc).reshape(-1))
    text = text.strip()
    if text:
      units += [u for u in _BOUNDARY.split(text + "\n\n") if u]
  return TextHaystack("text", units)


def render_prompt(user: str, answer_prefix: str, tokenizer, chat: bool = False) -> str:
  """The prompt string: the user's turn, then the answer prefix that starts the
  model's turn.

  Plain text (user + answer_prefix) unless `chat`: then the user's turn goes
  through the tokenizer directory's chat template (tokenizer_config.json
  `chat_template`, or chat_template.jinja) by lctx.data.chat.render_chat, the
  SFT conversation code, with the assistant header added, and the answer prefix
  follows it. `chat` without a template is a ConfigError.
  """
  if not chat:
    return user + answer_prefix
  if not _chat_template(tokenizer):
    raise ConfigError(
      f"EvalConfig.chat = True, but the tokenizer at "
      f"{getattr(tokenizer, 'model_path', None)!r} has no chat template "
      "(tokenizer_config.json chat_template or chat_template.jinja).",
      fix="Set EvalConfig.chat = False (plain-text prompts), or use an instruct model's tokenizer.",
    )
  from lctx.data import chat as chat_lib  # pylint: disable=g-import-not-at-top

  messages = [{"role": "user", "content": user}]
  return chat_lib.render_chat(messages, tokenizer.model_path, add_generation_prompt=True) + (
    answer_prefix
  )


def _chat_template(tokenizer) -> bool:
  path = getattr(tokenizer, "model_path", None)
  if not path:
    return False
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  if os.path.isfile(os.path.join(directory, "chat_template.jinja")):
    return True
  config = os.path.join(directory, "tokenizer_config.json")
  try:
    with open(config, encoding="utf-8") as f:
      return bool(json.load(f).get("chat_template"))
  except (OSError, ValueError):
    return False


def _encode(tokenizer, text: str) -> list[int]:
  return list(tokenizer.encode(text))


class _Context:
  """Haystack units and needle boundaries for one example, sized by n units."""

  def __init__(self, spec, haystack, tokenizer, rng, depth):
    self.spec, self.tok, self.depth = spec, tokenizer, depth
    self.units_iter = haystack.stream(spec, np.random.default_rng(rng.integers(1 << 62)))
    self.units, self.cum = [], [0]
    self.place_seed = int(rng.integers(1 << 62))

  def grow(self, n: int) -> None:
    while len(self.units) < n:
      u = next(self.units_iter)
      self.units.append(u)
      self.cum.append(self.cum[-1] + len(_encode(self.tok, u)))

  def slots(self, n: int) -> list[int]:
    """Boundary (insert before unit k, k in [0, n]) of each needle."""
    self.grow(n)
    cum = np.asarray(self.cum[: n + 1], np.float64)
    k_depth = int(np.argmin(np.abs(cum - self.depth * cum[-1])))
    r = np.random.default_rng(self.place_seed)
    out = []
    later = sorted(int(k) for k in r.integers(k_depth, n + 1, size=len(self.spec.needles)))
    for i, nd in enumerate(self.spec.needles):
      if nd.at_depth:
        out.append(k_depth)
      elif nd.after_depth:
        out.append(later[i])
      else:
        out.append(int(r.integers(0, n + 1)))
    return out

  def text(self, n: int, removed: bool) -> tuple[str, list[tuple[int, int, bool]]]:
    """(context, [(char start, char end, at_depth)] of the queried needles)."""
    slots = self.slots(n)
    parts, pos, spans = [], 0, []
    order = sorted(
      range(len(slots)), key=lambda i: (slots[i], not self.spec.needles[i].at_depth, i)
    )
    j = 0
    for k in range(n + 1):
      while j < len(order) and slots[order[j]] == k:
        nd = self.spec.needles[order[j]]
        j += 1
        if nd.queried:
          spans.append((pos, pos if removed else pos + len(nd.text), nd.at_depth))
          if removed:
            continue
        parts.append(nd.text + "\n")
        pos += len(nd.text) + 1
      if k < n:
        parts.append(self.units[k])
        pos += len(self.units[k])
    return "".join(parts).rstrip(), spans


def _fit(build, budget: int, estimate=None) -> int:
  """Largest n >= 0 with len(build(n)) <= budget (build's length grows with n)."""
  if len(build(0)) > budget:
    raise ValueError(f"no prompt fits {budget} tokens; use a longer length.")
  lo, hi = 0, max(1, estimate or 64)
  while len(build(hi)) <= budget:
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if len(build(mid)) <= budget else (lo, mid)
  return lo


def build_text_example(
  task: str,
  length: int,
  depth: float | None,
  seed: int,
  tokenizer,
  haystack: TextHaystack,
  *,
  needle_removed: bool = False,
  add_bos: bool = True,
  phrasing: str = "train",
  kinds: tuple[str, str] = ("words", "numbers"),
  reserve: int = 0,
  chat: bool = False,
) -> RetrievalExample:
  """One RULER example of at most `length` tokens (module docstring).
  `reserve`: tokens kept free after the prompt for decoding (at least the
  answer's)."""
  if phrasing not in PHRASINGS:
    raise ValueError(f"unknown phrasing {phrasing!r}; expected one of {PHRASINGS}.")
  rng = np.random.default_rng(seed)
  bos = [tokenizer.bos_id] if add_bos else []
  depthless = task in ruler.DEPTHLESS
  for _ in range(100):
    spec = ruler.draw_spec(task, rng, alt=phrasing == "held_out", kinds=kinds)
    ctx = None if depthless else _Context(spec, haystack, tokenizer, rng, depth or 0.0)
    keep = max(reserve, len(_encode(tokenizer, spec.answer(""))) + 2)
    budget = length - len(bos) - keep

    def prompt_of(n: int, removed: bool = needle_removed, spec=spec, ctx=ctx):
      context = spec.context(n) if depthless else ctx.text(n, removed)[0]
      return render_prompt(spec.head + context + spec.tail, spec.answer_prefix, tokenizer, chat)

    def ids_of(n: int, cache: dict[int, list[int]] = {}, prompt_of=prompt_of) -> list[int]:  # noqa: B006
      if n not in cache:
        cache[n] = _encode(tokenizer, prompt_of(n, False))
      return cache[n]

    estimate = None
    if not depthless:
      ctx.grow(8)
      per_unit = max(1.0, ctx.cum[8] / 8)
      estimate = int(max(1, (budget - len(ids_of(0))) / per_unit))
    n = _fit(ids_of, budget, estimate)
    if n < 1:
      raise ValueError(f"{task}: length {length} leaves no room for a haystack or context.")
    if depthless or not any(o.lower() in ctx.text(n, True)[0].lower() for o in spec.outputs):
      break
  else:
    raise ValueError(f"{task}: could not draw answers absent from the haystack.")

  prompt = prompt_of(n)
  ids = _encode(tokenizer, prompt)
  answer = spec.answer(prompt)
  answer_ids = _encode(tokenizer, answer)
  tokens = np.asarray(bos + ids + answer_ids, np.int32)
  head_chars = len(render_prompt(spec.head, "", tokenizer, False))
  at = lambda c: len(bos) + len(_encode(tokenizer, prompt[:c]))  # noqa: E731
  spans, depth_offset = [], None
  if not depthless:
    for s, e, at_depth in ctx.text(n, needle_removed)[1]:
      span = (at(head_chars + s), at(head_chars + e))
      spans.append(span)
      if at_depth:
        depth_offset = span[0]
  body_start = at(head_chars)
  body_end = at(len(prompt) - len(spec.tail) - len(spec.answer_prefix))
  return RetrievalExample(
    task=task,
    tokens=tokens,
    answer_start=len(bos) + len(ids),
    answer=answer,
    answer_items=spec.outputs,
    needle_spans=tuple(spans),
    depth_offset=body_start if depth_offset is None else depth_offset,
    body_start=body_start,
    body_len=body_end - body_start,
    depth=None if depthless else float(depth),
    seed=int(seed),
    needle_removed=needle_removed,
    haystack="own" if depthless else haystack.kind,
    chance=spec.chance,
    phrasing=phrasing,
    prompt=prompt,
    metric=spec.metric,
    max_new_tokens=ruler.TOKENS_TO_GENERATE[task],
  )
