"""Haystack fillers for the synthetic retrieval tasks, as token-id streams.

A haystack is an endless stream of filler token ids; a task takes exactly as many
as it needs, so needle placement is exact in tokens. Three kinds:

- "noise": the Landmark-Attention passkey filler (arXiv 2305.16300) repeated.
  This is the filler the training mixture uses.
- "alt_noise": a different set of short sentences that training never uses, so
  it can serve as a held-out haystack when no real text is available.
- "text": real text (e.g. validation-split documents), concatenated with blank
  lines between documents; each example starts at a seeded random offset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

NOISE_FILLER = (
  "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# Never used by make_training_example: the held-out filler.
ALT_NOISE_FILLER = (
  "The river runs to the sea. The hills are quiet. The wind is "
  "cold. On and on it goes. Far away and home again. "
)

HAYSTACK_KINDS = ("noise", "alt_noise", "text")


class Haystack:
  """A source of filler tokens: `take(n, rng) -> int32 [n]`.

  `tokens` is the base stream ([S] int32). For the repeated fillers every example
  starts at offset 0 (the Landmark layout); for real text the start offset is
  drawn from `rng`, and the stream wraps around when it runs out.
  """

  def __init__(self, kind: str, tokens: np.ndarray, random_start: bool):
    if tokens.size == 0:
      raise ValueError(f"haystack {kind!r} has no tokens.")
    self.kind = kind
    self.tokens = np.asarray(tokens, dtype=np.int32)
    self.random_start = random_start

  def take(self, n: int, rng: np.random.Generator) -> np.ndarray:
    """Returns int32 [n] filler ids (always consumes one rng draw)."""
    start = int(rng.integers(0, self.tokens.size))
    if not self.random_start:
      start = 0
    reps = (start + n) // self.tokens.size + 1
    stream = np.tile(self.tokens, reps) if reps > 1 else self.tokens
    return stream[start : start + n].copy()


def make_haystack(
  kind: str,
  tokenizer,
  documents: Iterable[str | np.ndarray] | None = None,
  *,
  max_tokens: int = 1 << 22,
) -> Haystack:
  """Builds a haystack of `kind` in HAYSTACK_KINDS with `tokenizer`.

  `documents` (strings, or already-tokenized int arrays) are required for
  "text"; at most `max_tokens` of them are used (the stream wraps, so a small
  corpus still fills any length).
  """
  if kind == "noise":
    return Haystack(kind, _repeat_encode(tokenizer, NOISE_FILLER), False)
  if kind == "alt_noise":
    return Haystack(kind, _repeat_encode(tokenizer, ALT_NOISE_FILLER), False)
  if kind == "text":
    if documents is None:
      raise ValueError("haystack 'text' needs documents (a list of strings).")
    parts, total = [], 0
    sep = np.asarray(tokenizer.encode("\n\n"), dtype=np.int32)
    for doc in documents:
      ids = np.asarray(
        tokenizer.encode(doc) if isinstance(doc, str) else doc, dtype=np.int32
      ).reshape(-1)
      parts += [ids, sep]
      total += ids.size + sep.size
      if total >= max_tokens:
        break
    if total == 0:
      raise ValueError("haystack 'text' got no non-empty documents.")
    return Haystack(kind, np.concatenate(parts)[:max_tokens], True)
  raise ValueError(f"unknown haystack kind {kind!r}; expected one of {HAYSTACK_KINDS}.")


def _repeat_encode(tokenizer, sentence_block: str) -> np.ndarray:
  # Encode many repeats at once so a subword tokenizer sees natural boundaries;
  # the stream then tiles this block.
  return np.asarray(tokenizer.encode(sentence_block * 16), dtype=np.int32)


def contains(haystack_ids: np.ndarray, needle_ids: Sequence[int]) -> bool:
  """True when `needle_ids` occurs as a contiguous run inside `haystack_ids`."""
  needle = np.asarray(needle_ids, dtype=np.int32)
  n, h = needle.size, np.asarray(haystack_ids, dtype=np.int32)
  if n == 0 or n > h.size:
    return n == 0
  windows = np.lib.stride_tricks.sliding_window_view(h, n)
  return bool(np.any(np.all(windows == needle, axis=1)))
