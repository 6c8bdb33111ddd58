"""Synthetic long-range retrieval tasks (passkey, RULER NIAH, variable tracking).

Layout of one example, exactly `length` tokens:

    [BOS] body ............................................ question answer
          |<------------- body_len tokens ------------->|

The body is haystack filler with needles spliced in at token offsets. The needle
that the grid's `depth` positions starts at body offset
`round(depth * (body_len - needle_len))`: depth 0 puts its first token at the
start of the body, depth 1 puts its last token at the end of the body (right
before the question). Sequence offset = body offset + 1 with BOS. Other needles
(distractors, extra values, variable-chain hops) go to seeded random,
non-overlapping offsets. Placement is done on token ids, so it is exact for any
tokenizer (pieces are encoded separately and concatenated).

Every example is a pure function of (task, length, depth, seed, haystack): the
needle-removed control rebuilds it from the same seed and fills the queried
needles' spans with filler instead, and the values are redrawn until none of the
answer strings occurs in the filler, so the control context never contains the
answer. Eval seeds live in [EVAL_SEED_BASE, 2**63); training seeds below it.

Each task has two phrasings of its needles and question: "train" (the RULER /
Landmark wording, the only one the training mixture uses) and "held_out" (same
structure, different words), so the grid can report a needle format the model
never saw: a model that retrieves should carry over, one that learned the format
will not.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import numpy as np

from lctx.evals.haystack import Haystack, make_haystack

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
PHRASINGS = ("train", "held_out")
EVAL_SEED_BASE = 1 << 62  # eval seeds are >= this; training seeds are below.

_WORDS = [
  "amber",
  "apple",
  "arrow",
  "autumn",
  "badge",
  "basket",
  "bishop",
  "blossom",
  "bottle",
  "breeze",
  "bronze",
  "cactus",
  "candle",
  "canyon",
  "carbon",
  "castle",
  "cedar",
  "cherry",
  "cobalt",
  "comet",
  "copper",
  "coral",
  "cotton",
  "crystal",
  "dagger",
  "desert",
  "dolphin",
  "dragon",
  "eagle",
  "ember",
  "falcon",
  "feather",
  "forest",
  "garnet",
  "glacier",
  "granite",
  "harbor",
  "hazel",
  "helmet",
  "island",
  "ivory",
  "jasmine",
  "jungle",
  "kettle",
  "lantern",
  "lemon",
  "lizard",
  "magnet",
  "maple",
  "marble",
  "meadow",
  "meteor",
  "mirror",
  "orchid",
  "otter",
  "panther",
  "pepper",
  "pillow",
  "planet",
  "quartz",
  "raven",
  "ribbon",
  "saddle",
  "salmon",
  "silver",
  "spider",
  "tiger",
  "timber",
  "tulip",
  "velvet",
  "violet",
  "walnut",
  "willow",
]
_LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))


@dataclasses.dataclass(frozen=True)
class RetrievalExample:
  """One example. `tokens` is int32 [length]; the answer is
  tokens[answer_start:], so the model scores it under teacher forcing from the
  logits at positions answer_start-1 .. length-2."""

  task: str
  tokens: np.ndarray
  answer_start: int
  answer: str  # gold answer text (what greedy decoding must emit)
  answer_items: tuple[str, ...]  # strings the context must hold for an answer
  needle_spans: tuple[tuple[int, int], ...]  # [start, end) of queried needles
  depth_offset: int  # sequence offset of the depth-placed needle
  body_start: int
  body_len: int
  depth: float
  seed: int
  needle_removed: bool
  haystack: str
  chance: float  # probability of guessing the answer uniformly
  phrasing: str = "train"  # "train" or "held_out" (never in training data)
  prompt: str = ""  # the prompt string (RULER text prompts; "" for spliced ones)
  metric: str = "all"  # RULER's metric on a generation: string_match_all or _part
  max_new_tokens: int = 16  # the task's decoding budget (RULER's tokens_to_generate)


@dataclasses.dataclass(frozen=True)
class _Needle:
  text: str
  queried: bool  # removed in the needle-removed control
  at_depth: bool  # the one placed at the requested depth
  item: str = ""  # value this needle contributes to the answer (multivalue)


@dataclasses.dataclass(frozen=True)
class _Spec:
  needles: tuple[_Needle, ...]
  question: str
  answer: str
  items: tuple[str, ...]
  chance: float
  answer_in_order: bool = False  # answer lists queried items by position


def _number(rng, digits: int) -> str:
  return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def _distinct(rng, draw: Callable[[], str], n: int) -> list[str]:
  out: list[str] = []
  while len(out) < n:
    x = draw()
    if x not in out:
      out.append(x)
  return out


def _key(rng) -> str:
  a, b = rng.choice(len(_WORDS), size=2, replace=False)
  return f"{_WORDS[a]}-{_WORDS[b]}"


def _niah_needle(key: str, value: str, alt: bool) -> str:
  if alt:
    return f" The hidden number that belongs to {key} is: {value}. "
  return f" One of the special magic numbers for {key} is: {value}. "


def _niah_question(key: str, alt: bool) -> str:
  # RULER's question; the answer prefix ends like the needle ("for {key} is:")
  # instead of RULER's "... mentioned in the provided text is" (documented).
  if alt:
    return (
      f" Which hidden number belongs to {key} in the text above? The "
      f"hidden number that belongs to {key} is:"
    )
  return (
    f" What is the special magic number for {key} mentioned in the "
    f"provided text? The special magic number for {key} is:"
  )


def _passkey(rng, alt: bool) -> _Spec:
  k = _number(rng, 5)
  if alt:
    needle = f" The secret code is {k}. Keep it safe. {k} is the secret code. "
    question = " What is the secret code? The secret code is"
  else:
    needle = f" The pass key is {k}. Remember it. {k} is the pass key. "
    question = " What is the pass key? The pass key is"
  return _Spec((_Needle(needle, True, True),), question, f" {k}", (k,), 1 / 9e4)


def _niah_single(rng, alt: bool) -> _Spec:
  key, value = _key(rng), _number(rng, 7)
  return _Spec(
    (_Needle(_niah_needle(key, value, alt), True, True),),
    _niah_question(key, alt),
    f" {value}",
    (value,),
    1 / 9e6,
  )


def _niah_multikey(rng, alt: bool, num_keys: int = 4) -> _Spec:
  keys = _distinct(rng, lambda: _key(rng), num_keys)
  values = _distinct(rng, lambda: _number(rng, 7), num_keys)
  needles = [_Needle(_niah_needle(keys[0], values[0], alt), True, True)]
  needles += [_Needle(_niah_needle(k, v, alt), False, False) for k, v in zip(keys[1:], values[1:])]
  return _Spec(tuple(needles), _niah_question(keys[0], alt), f" {values[0]}", (values[0],), 1 / 9e6)


def _niah_multivalue(rng, alt: bool, num_values: int = 4) -> _Spec:
  key = _key(rng)
  values = _distinct(rng, lambda: _number(rng, 7), num_values)
  needles = tuple(_Needle(_niah_needle(key, v, alt), True, i == 0, v) for i, v in enumerate(values))
  if alt:
    question = (
      f" Which hidden numbers belong to {key} in the text above? The "
      f"hidden numbers that belong to {key} are:"
    )
  else:
    question = (
      f" What are all the special magic numbers for {key} mentioned "
      f"in the provided text? The special magic numbers for {key} are:"
    )
  return _Spec(
    needles,
    question,
    " " + ", ".join(values),
    tuple(values),
    (1 / 9e6) ** num_values,
    answer_in_order=True,
  )


def _variable_tracking(rng, alt: bool, num_vars: int = 5) -> _Spec:
  value = _number(rng, 5)
  names = _distinct(rng, lambda: "".join(rng.choice(_LETTERS, 5)), num_vars)
  if alt:
    needles = [_Needle(f" LET {names[0]} BE {value}. ", True, True)]
    needles += [_Needle(f" LET {b} BE {a}. ", True, False) for a, b in zip(names[:-1], names[1:])]
    question = (
      f" Which names end up holding {value} in the text above? The names holding {value} are:"
    )
  else:
    needles = [_Needle(f" VAR {names[0]} = {value}. ", True, True)]
    needles += [
      _Needle(f" VAR {b} = VAR {a}. ", True, False) for a, b in zip(names[:-1], names[1:])
    ]
    question = (
      f" Find all variables that are assigned the value {value} in "
      f"the text above. The variables assigned the value {value} are:"
    )
  return _Spec(
    tuple(needles), question, " " + " ".join(names), tuple(names), 26.0 ** (-5 * num_vars)
  )


_BUILDERS: dict[str, Callable[[np.random.Generator, bool], _Spec]] = {
  "passkey": _passkey,
  "niah_single": _niah_single,
  "niah_multikey": _niah_multikey,
  "niah_multivalue": _niah_multivalue,
  "variable_tracking": _variable_tracking,
}


def depth_offset(depth: float, body_len: int, needle_len: int) -> int:
  """Body offset of the depth-placed needle: round(depth * (body_len - needle_len))."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be a fraction in [0, 1], got {depth}.")
  return int(round(depth * (body_len - needle_len)))


def _place(rng, lengths: list[int], main: int, main_offset: int, body_len: int) -> list[int]:
  """Body offsets for needles of `lengths`; needle `main` at `main_offset`, the
  others at random non-overlapping offsets in the free space left or right."""
  regions = [[0, main_offset, []], [main_offset + lengths[main], body_len, []]]
  others = [i for i in range(len(lengths)) if i != main]
  for i in rng.permutation(others):
    free = [r[1] - r[0] - sum(lengths[j] for j in r[2]) for r in regions]
    fits = [f >= lengths[i] for f in free]
    if not any(fits):
      raise ValueError(
        f"body of {body_len} tokens is too short for needles of {lengths} "
        "tokens; use a longer length."
      )
    p = np.array([f if ok else 0 for f, ok in zip(free, fits)], dtype=np.float64)
    regions[int(rng.choice(2, p=p / p.sum()))][2].append(int(i))
  offsets = [0] * len(lengths)
  offsets[main] = main_offset
  for start, end, members in regions:
    slack = end - start - sum(lengths[j] for j in members)
    cuts = np.sort(rng.integers(0, slack + 1, size=len(members)))
    pos = start
    for j, cut, prev in zip(members, cuts, np.concatenate([[0], cuts[:-1]])):
      pos += int(cut - prev)
      offsets[j] = pos
      pos += lengths[j]
  return offsets


def build_example(
  task: str,
  length: int,
  depth: float,
  seed: int,
  tokenizer,
  haystack: Haystack,
  *,
  needle_removed: bool = False,
  add_bos: bool = True,
  phrasing: str = "train",
) -> RetrievalExample:
  """Builds one example of exactly `length` tokens (see the module docstring).
  `phrasing` in PHRASINGS picks the needle and question wording."""
  if task not in _BUILDERS:
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}.")
  if phrasing not in PHRASINGS:
    raise ValueError(f"unknown phrasing {phrasing!r}; expected one of {PHRASINGS}.")
  rng = np.random.default_rng(seed)
  enc = lambda s: np.asarray(tokenizer.encode(s), dtype=np.int32)
  prefix = np.asarray([tokenizer.bos_id] if add_bos else [], dtype=np.int32)
  for _ in range(100):  # redraw until no answer string occurs in the filler
    spec = _BUILDERS[task](rng, phrasing == "held_out")
    needles = [enc(n.text) for n in spec.needles]
    q_ids, a_ids = enc(spec.question), enc(spec.answer)
    body_len = length - prefix.size - q_ids.size - a_ids.size
    lens = [n.size for n in needles]
    if body_len < sum(lens):
      raise ValueError(
        f"{task}: length {length} leaves {body_len} body tokens but the "
        f"needles need {sum(lens)}; use a length of at least "
        f"{length - body_len + sum(lens) + 16}."
      )
    filler = haystack.take(body_len, rng)
    main = next(i for i, n in enumerate(spec.needles) if n.at_depth)
    offsets = _place(rng, lens, main, depth_offset(depth, body_len, lens[main]), body_len)
    answer = spec.answer
    if spec.answer_in_order:
      order = sorted((o, n.item) for o, n in zip(offsets, spec.needles) if n.queried)
      answer = " " + ", ".join(item for _, item in order)
      if enc(answer).size != a_ids.size:
        continue  # a subword tokenizer split the reordered answer differently
      a_ids = enc(answer)
    filler_text = tokenizer.decode(filler)
    if not any(item in filler_text for item in spec.items):
      break
  else:
    raise ValueError(f"{task}: could not draw answers absent from the haystack.")

  body, taken, cursor = np.empty(body_len, np.int32), 0, 0
  spans = []
  for off, ids, nd in sorted(zip(offsets, needles, spec.needles), key=lambda x: x[0]):
    gap = off - cursor
    body[cursor:off] = filler[taken : taken + gap]
    taken += gap
    if nd.queried:
      spans.append((prefix.size + off, prefix.size + off + ids.size))
    if needle_removed and nd.queried:
      body[off : off + ids.size] = filler[taken : taken + ids.size]
      taken += ids.size
    else:
      body[off : off + ids.size] = ids
    cursor = off + ids.size
  body[cursor:] = filler[taken : taken + body_len - cursor]
  tokens = np.concatenate([prefix, body, q_ids, a_ids]).astype(np.int32)
  assert tokens.size == length, (tokens.size, length)
  return RetrievalExample(
    task=task,
    tokens=tokens,
    answer_start=length - a_ids.size,
    answer=answer,
    answer_items=spec.items,
    needle_spans=tuple(spans),
    depth_offset=prefix.size + offsets[main],
    body_start=prefix.size,
    body_len=body_len,
    depth=float(depth),
    seed=int(seed),
    needle_removed=needle_removed,
    haystack=haystack.kind,
    chance=spec.chance,
    phrasing=phrasing,
  )


def eval_seed(base_seed: int, *parts) -> int:
  """A stable seed in the reserved eval range [EVAL_SEED_BASE, 2**63) for the
  cell/sample named by `parts` (e.g. task, length, depth index, sample)."""
  key = repr((int(base_seed),) + tuple(parts)).encode()
  h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
  return EVAL_SEED_BASE + h % ((1 << 63) - EVAL_SEED_BASE)


def draw_training_seed(rng: np.random.Generator) -> int:
  """A seed below EVAL_SEED_BASE, so training never rebuilds an eval example."""
  return int(rng.integers(0, EVAL_SEED_BASE))


def make_training_example(
  task: str,
  length: int,
  rng: np.random.Generator,
  tokenizer=None,
  *,
  haystack: Haystack | None = None,
  add_bos: bool = True,
  answer_loss_only: bool = False,
) -> dict[str, np.ndarray]:
  """One training row for the data mixture, in the batch-contract layout.

  Draws a training seed (disjoint from eval seeds) and a depth uniform in
  [0, 1] from `rng`; the haystack defaults to the "noise" filler (the
  "alt_noise" filler, real-text haystacks and the "held_out" phrasing stay
  held out: this function always uses the "train" phrasing). Returns
  `inputs, targets, positions, segment_ids` int32 [length] and `loss_mask`
  float32 [length] (`targets` = inputs shifted left, EOS last; with
  `answer_loss_only` only the answer tokens carry loss), plus `seed` and
  `answer_start` as int64 scalars.
  """
  if tokenizer is None:
    from lctx.data.tokenizers import ByteTokenizer  # tokenizer only, no pipeline

    tokenizer = ByteTokenizer()
  if haystack is None:
    haystack = make_haystack("noise", tokenizer)
  seed = draw_training_seed(rng)
  ex = build_example(task, length, float(rng.random()), seed, tokenizer, haystack, add_bos=add_bos)
  targets = np.concatenate([ex.tokens[1:], [tokenizer.eos_id]]).astype(np.int32)
  loss_mask = np.ones(length, np.float32)
  if answer_loss_only:
    loss_mask[:] = 0.0
    loss_mask[ex.answer_start - 1 : length - 1] = 1.0
  return {
    "inputs": ex.tokens,
    "targets": targets,
    "positions": np.arange(length, dtype=np.int32),
    "segment_ids": np.ones(length, np.int32),
    "loss_mask": loss_mask,
    "seed": np.int64(seed),
    "answer_start": np.int64(ex.answer_start),
  }


def training_example_at(
  task: str,
  length: int,
  index: int,
  *,
  seed: int = 0,
  tokenizer=None,
  haystack: Haystack | None = None,
  add_bos: bool = True,
  answer_loss_only: bool = False,
) -> dict[str, np.ndarray]:
  """Random-access form of make_training_example for index-based sources:
  a pure function of (task, length, index, seed), always with a training seed
  (< EVAL_SEED_BASE)."""
  key = repr(("train", int(seed), task, int(length), int(index))).encode()
  h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
  return make_training_example(
    task,
    length,
    np.random.default_rng(h),
    tokenizer,
    haystack=haystack,
    add_bos=add_bos,
    answer_loss_only=answer_loss_only,
  )
