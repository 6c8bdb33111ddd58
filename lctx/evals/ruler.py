"""RULER's synthetic tasks as text (arXiv 2404.06654, github.com/NVIDIA/RULER).

Each task draws a `TextSpec`: RULER's template split around its context
(`head` = the instruction, `tail` = the question and the answer prefix), the
needles to insert into a haystack at sentence or line boundaries, or, for the
tasks whose context is their own (cwe, fwe), a `context(n)` of size n. The
prompt string is head + context + tail; lctx/evals/prompts.py fits n to a token
budget and tokenizes the whole string once.

Templates, needle sentences and the metrics follow RULER's
scripts/data/synthetic/constants.py, niah.py, variable_tracking.py,
common_words_extraction.py, freq_words_extraction.py and
scripts/eval/synthetic/constants.py. Deviations, all on purpose:
- keys drawn as word pairs ("amber-falcon") from a fixed list and cwe words as
  pseudo-words of two or three syllables (RULER draws English words with the
  `wonderwords` package, which lctx does not depend on);
- cwe has no one-shot example in its prompt;
- the needle at the grid's `depth` goes to the boundary nearest that depth in
  tokens (RULER draws needle positions at random; so do the other needles here);
- `passkey` (Landmark / LongLoRA wording) is not a RULER task; it is kept.

Every task here is scored by string_match_all (RULER's QA tasks, scored with
string_match_part, come from task files: lctx/evals/task_files.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from lctx.evals.tasks import _LETTERS, _WORDS

TEXT_TASKS = (
  "passkey",
  "niah_single",
  "niah_multikey",
  "niah_multivalue",
  "niah_multiquery",
  "variable_tracking",
  "cwe",
  "fwe",
)
NEEDLE_KINDS = ("numbers", "words", "uuids")
DEPTHLESS = ("cwe", "fwe")  # the context is the task: no needle, no depth
# RULER's tokens_to_generate per task (the decoding budget's upper bound).
TOKENS_TO_GENERATE = {
  "passkey": 16,
  "niah_single": 128,
  "niah_multikey": 128,
  "niah_multivalue": 128,
  "niah_multiquery": 128,
  "variable_tracking": 30,
  "cwe": 120,
  "fwe": 50,
}

NIAH_TEMPLATE = (
  "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
  "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
  "the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = (
  " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
  "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
  "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
  " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
  "variables are assgined the value {query}, they are: "
)
CWE_TEMPLATE = (
  "Below is a numbered list of words. In these words, some appear more often than others. "
  "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
  "words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
  "Read the following coded text and track the frequency of each coded word. Find the three "
  "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
  "Please ignore the dots '....'. What are the three most frequently appeared words in the "
  "above coded text?"
)
FWE_ANSWER_PREFIX = (
  " Answer: According to the coded text above, the three most frequently appeared words are:"
)
PASSKEY_TEMPLATE = (
  "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
  "them. I will quiz you about the important information there.\n{context}\n"
  "What is the pass key?"
)
PASSKEY_ANSWER_PREFIX = " The pass key is"
PASSKEY_NEEDLE = "The pass key is {k}. Remember it. {k} is the pass key."


# ----------------------------------------------------------------------------
# RULER's metrics (scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py)
# ----------------------------------------------------------------------------
def postprocess_pred(text: str) -> str:
  """RULER's postprocess_pred: strip, control characters to newlines, strip."""
  return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
  """Percent: mean over predictions of the fraction of references in it (case-insensitive)."""
  score = sum(
    sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
    for p, ref in zip(preds, refs)
  )
  return round(score / len(preds) * 100, 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
  """Percent: mean over predictions of 1 if any reference is in it (case-insensitive)."""
  score = sum(
    max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs)
  )
  return round(score / len(preds) * 100, 2)


METRICS = {"all": string_match_all, "part": string_match_part}


def example_score(pred: str, refs: Sequence[str], metric: str = "all") -> float:
  """One prediction's score as a fraction in [0, 1] (the metric / 100, unrounded)."""
  p = postprocess_pred(pred).lower()
  hits = [r.lower() in p for r in refs]
  return float(np.mean(hits)) if metric == "all" else float(any(hits))


# ----------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TextNeedle:
  text: str
  queried: bool  # removed in the needle-removed control
  at_depth: bool = False  # the one placed at the grid's depth
  after_depth: bool = False  # placed after the depth needle (a chain's later hops)


@dataclasses.dataclass(frozen=True)
class TextSpec:
  head: str  # template text before {context}: the instruction
  tail: str  # template text after {context}: the question
  answer_prefix: str  # RULER's answer prefix, the start of the model's turn
  outputs: tuple[str, ...]  # RULER's references
  answer_lead: str  # before the teacher-forced answer: " " or "" (prefix ends in a space)
  chance: float
  needles: tuple[TextNeedle, ...] = ()
  context: Callable[[int], str] | None = None  # cwe / fwe: the context of size n
  metric: str = "all"
  distractor: Callable[[np.random.Generator], str] | None = None  # the "needle" haystack
  in_context_order: bool = True  # teacher-forced answer lists outputs as the context does

  def answer(self, prompt: str) -> str:
    """The teacher-forced continuation: the outputs joined by ", ", in the
    order they first occur in `prompt` (fwe: by rank)."""
    outs = list(self.outputs)
    if self.in_context_order:
      outs.sort(key=lambda o: _first(prompt, o))
    return self.answer_lead + ", ".join(outs)


def _first(text: str, word: str) -> int:
  m = re.search(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])", text)
  return m.start() if m else len(text)


def _split(template: str, prefix: str, **fields) -> tuple[str, str, str]:
  head, tail = template.split("{context}")
  return head.format(**fields), tail.format(**fields), prefix.format(**fields)


def _singular(text: str) -> str:
  """RULER's rewrite of the niah template for one query and one value."""
  return (
    text.replace("Some", "A")
    .replace("are all", "is")
    .replace("are", "is")
    .replace("answers", "answer")
  )


def _draw(rng: np.random.Generator, kind: str) -> str:
  if kind == "numbers":
    return str(int(rng.integers(1_000_000, 10_000_000)))
  if kind == "words":
    a, b = rng.choice(len(_WORDS), size=2, replace=False)
    return f"{_WORDS[a]}-{_WORDS[b]}"
  if kind == "uuids":
    h = "".join(rng.choice(list("0123456789abcdef"), 32))
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{h[16:20]}-{h[20:]}"
  raise ValueError(f"unknown needle kind {kind!r}; expected one of {NEEDLE_KINDS}.")


def _distinct(rng, kind: str, n: int, avoid=()) -> list[str]:
  out: list[str] = []
  while len(out) < n:
    x = _draw(rng, kind)
    if x not in out and x not in avoid:
      out.append(x)
  return out


def _alt(text: str, alt: bool) -> str:
  """The held-out phrasing: the same structure in other words."""
  if not alt:
    return text
  return text.replace("special magic", "secret").replace("pass key", "secret code")


def _niah(rng, alt, kinds, num_k=1, num_v=1, num_q=1) -> TextSpec:
  kind_k, kind_v = kinds
  num_k = max(num_k, num_q)
  keys = _distinct(rng, kind_k, num_k)
  values = [_distinct(rng, kind_v, num_v) for _ in keys]
  queried = [int(i) for i in rng.choice(num_k, size=num_q, replace=False)]
  needles = []
  for i, (key, vals) in enumerate(zip(keys, values)):
    for j, v in enumerate(vals):
      text = _alt(NIAH_NEEDLE.format(type_needle_v=kind_v, key=key, value=v), alt)
      needles.append(TextNeedle(text, i in queried, at_depth=(i == queried[0] and j == 0)))
  query = ", ".join(keys[i] for i in queried[:-1]) + ", and " if num_q > 1 else ""
  query += keys[queried[-1]]
  singular = num_q * num_v == 1
  template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
  if singular:
    template, prefix = _singular(template), _singular(prefix)
  head, tail, prefix = (
    part.replace("{query}", query)
    for part in _split(
      _alt(template, alt),
      _alt(prefix, alt),
      type_needle_v=kind_v[:-1] if singular else kind_v,
      query="{query}",
    )
  )
  outputs = tuple(v for i in queried for v in values[i])
  chance = {"numbers": 1 / 9e6, "words": 1 / len(_WORDS) ** 2, "uuids": 16.0**-31}[kind_v]
  distractor = lambda r: _alt(  # noqa: E731  (RULER's "needle" haystack)
    NIAH_NEEDLE.format(type_needle_v=kind_v, key=_draw(r, kind_k), value=_draw(r, kind_v)), alt
  )
  return TextSpec(
    head,
    tail,
    prefix,
    outputs,
    " ",
    chance ** len(outputs),
    tuple(needles),
    distractor=distractor,
  )


def _passkey(rng, alt, kinds) -> TextSpec:
  del kinds
  k = str(int(rng.integers(10_000, 100_000)))
  head, tail, prefix = _split(_alt(PASSKEY_TEMPLATE, alt), _alt(PASSKEY_ANSWER_PREFIX, alt))
  needle = TextNeedle(_alt(PASSKEY_NEEDLE.format(k=k), alt), True, at_depth=True)
  return TextSpec(head, tail, prefix, (k,), " ", 1 / 9e4, (needle,))


def _variable_tracking(rng, alt, kinds, num_hops: int = 4) -> TextSpec:
  if alt:
    raise ValueError("variable_tracking has no held-out phrasing.")
  del kinds
  value = str(int(rng.integers(10_000, 100_000)))
  names: list[str] = []
  while len(names) < num_hops + 1:
    name = "".join(rng.choice(_LETTERS, 5))
    if name not in names:
      names.append(name)
  chain = [TextNeedle(f"VAR {names[0]} = {value}", True, at_depth=True)]
  chain += [
    TextNeedle(f"VAR {b} = VAR {a} ", True, after_depth=True) for a, b in zip(names, names[1:])
  ]
  head, tail, prefix = _split(VT_TEMPLATE, VT_ANSWER_PREFIX, query=value, num_v=num_hops + 1)
  return TextSpec(head, tail, prefix, tuple(names), "", 26.0 ** (-5 * len(names)), tuple(chain))


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pseudo_words(rng, n: int, avoid=()) -> list[str]:
  """n distinct pseudo-words (two syllables; three when n is large)."""
  syllables = 2 if n < 2000 else 3
  out: dict[str, None] = {}
  while len(out) < n:
    w = "".join(rng.choice(list(_CONSONANTS)) + rng.choice(list(_VOWELS)) for _ in range(syllables))
    if w not in avoid:
      out[w] = None
  return list(out)


def _cwe(rng, alt, kinds, freq_cw=30, freq_ucw=3, num_cw=10) -> TextSpec:
  """RULER's common-words extraction: num_cw words x freq_cw among n uncommon
  words x freq_ucw, shuffled, numbered "1. w 2. w ..."."""
  if alt:
    raise ValueError("cwe has no held-out phrasing.")
  del kinds
  common = _pseudo_words(rng, num_cw)
  seed = int(rng.integers(1 << 31))

  def context(n: int) -> str:
    r = np.random.default_rng(seed)
    uncommon = _pseudo_words(r, n, avoid=set(common))
    words = common * freq_cw + uncommon * freq_ucw
    order = r.permutation(len(words))
    return " ".join(f"{i + 1}. {words[j]}" for i, j in enumerate(order))

  head, tail, prefix = _split(CWE_TEMPLATE, CWE_ANSWER_PREFIX)
  return TextSpec(head, tail, prefix, tuple(common), " ", 0.0, context=context)


def _fwe(rng, alt, kinds, vocab_size=2000, word_len=6, alpha=2.0) -> TextSpec:
  """RULER's frequent-words extraction: n coded words drawn by a Zipf law
  (count of rank k = n k^-alpha / zeta(alpha)); rank 1 is the noise '...'; the
  answer is ranks 2-4."""
  if alt:
    raise ValueError("fwe has no held-out phrasing.")
  del kinds
  vocab: dict[str, None] = {}
  while len(vocab) < vocab_size:
    vocab["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), word_len))] = None
  words = list(vocab)
  words[0] = "..."
  seed = int(rng.integers(1 << 31))
  zeta = sum(k**-alpha for k in range(1, 100_000)) + 1 / ((alpha - 1) * 100_000 ** (alpha - 1))

  def context(n: int) -> str:
    counts = (n * np.arange(1, vocab_size + 1, dtype=np.float64) ** -alpha / zeta).astype(int)
    sampled = [w for w, c in zip(words, counts) for _ in range(c)]
    order = np.random.default_rng(seed).permutation(len(sampled))
    return " ".join(sampled[j] for j in order)

  head, tail, prefix = _split(FWE_TEMPLATE, FWE_ANSWER_PREFIX)
  top = tuple(words[1:4])
  return TextSpec(head, tail, prefix, top, " ", 0.0, context=context, in_context_order=False)


SPECS: dict[str, Callable[..., TextSpec]] = {
  "passkey": _passkey,
  "niah_single": _niah,
  "niah_multikey": lambda rng, alt, kinds: _niah(rng, alt, kinds, num_k=4),
  "niah_multivalue": lambda rng, alt, kinds: _niah(rng, alt, kinds, num_v=4),
  "niah_multiquery": lambda rng, alt, kinds: _niah(rng, alt, kinds, num_q=4),
  "variable_tracking": _variable_tracking,
  "cwe": _cwe,
  "fwe": _fwe,
}


def draw_spec(
  task: str, rng: np.random.Generator, *, alt: bool = False, kinds=("words", "numbers")
) -> TextSpec:
  """The task's spec for one example; `kinds` = (key kind, value kind) of the
  niah needles, each in NEEDLE_KINDS."""
  if task not in SPECS:
    raise ValueError(f"unknown task {task!r}; expected one of {TEXT_TASKS}.")
  for k in kinds:
    if k not in NEEDLE_KINDS:
      raise ValueError(f"unknown needle kind {k!r}; expected one of {NEEDLE_KINDS}.")
  return SPECS[task](rng, alt, tuple(kinds))
