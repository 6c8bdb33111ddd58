"""Synthetic long-range copy task: needs no corpus, and needs distant context.

One document (shown for the byte tokenizer; any tokenizer works):

    <bos>key: q7vz3kd0ab
    The sky is blue. Here we go. The grass is green. ... (filler)
    copy: q7vz3kd0ab
    <eos>

The key is random lowercase letters and digits, so it cannot be predicted
except by looking back across the filler. Loss choice (documented in
`DataConfig.copy_loss_on`):
  * 'copy' (default): loss_mask = 1 only on the copied key, the newline after it
    and EOS: exactly the tokens the context determines. The filler and the
    first key are unpredictable or trivially local, and would only dilute the
    signal a small model needs to learn to attend far back.
  * 'all': loss on every target, like ordinary text (useful when the copy task
    is the only source and you want a plain LM loss curve).

A document is a pure function of (seed, split, index), so the source is random
access, deterministic, and shards by index like any other source.
"""

from __future__ import annotations

import zlib

import numpy as np

FILLER_SENTENCES = (
  "The grass is green.",
  "The sky is blue.",
  "The sun is yellow.",
  "Here we go.",
  "There and back again.",
)
_KEY_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", np.uint8)


def _split_id(split: str) -> int:
  return zlib.crc32(split.encode())


def min_copy_seq_len(max_key_len: int) -> int:
  """Smallest seq_len that holds a copy document with an empty filler."""
  return 2 + len("key: \n") + len("\ncopy: ") + 2 * max_key_len + len("\n") - 1


def copy_document(
  index: int,
  *,
  seed: int,
  split: str,
  max_tokens: int,
  tokenizer,
  min_key_len: int = 8,
  max_key_len: int = 32,
  loss_on: str = "copy",
) -> tuple[np.ndarray, np.ndarray]:
  """Document `index` of the copy task.

  Returns (tokens int32 [L], target_mask float32 [L]) with L <= max_tokens + 1
  (BOS and EOS included) for the byte tokenizer, so the whole document fits in
  one row of seq_len = max_tokens (fewer tokens with SentencePiece).
  target_mask[j] says whether token j, when it is a target, counts in the loss.
  """
  if loss_on not in ("copy", "all"):
    raise ValueError(f"copy task loss_on must be 'copy' or 'all', got {loss_on!r}.")
  rng = np.random.default_rng([seed, _split_id(split), index])
  key_len = int(rng.integers(min_key_len, max_key_len + 1))
  key = _KEY_ALPHABET[rng.integers(0, len(_KEY_ALPHABET), key_len)].tobytes().decode()
  head = f"key: {key}\n"
  tail_prefix = "\ncopy: "
  tail = f"{key}\n"
  # Byte budget for the filler so that BOS + text + EOS fits in max_tokens + 1.
  budget = max_tokens + 1 - 2 - len(head) - len(tail_prefix) - len(tail)
  if max_tokens < min_copy_seq_len(max_key_len):
    raise ValueError(
      f"copy task needs seq_len >= {min_copy_seq_len(max_key_len)} for keys of "
      f"up to {max_key_len} characters, got seq_len={max_tokens}."
    )
  filler_len = int(rng.integers(0, budget + 1))
  # Enough random sentences, then cut to length: not periodic, cheap to make.
  picks = rng.integers(0, len(FILLER_SENTENCES), filler_len // 11 + 2)
  filler = " ".join(FILLER_SENTENCES[i] for i in picks)[:filler_len]

  context = np.asarray(tokenizer.encode(head + filler + tail_prefix), np.int32)
  copied = np.asarray(tokenizer.encode(tail), np.int32)
  tokens = np.concatenate([[tokenizer.bos_id], context, copied, [tokenizer.eos_id]])
  tokens = tokens.astype(np.int32)
  if loss_on == "all":
    mask = np.ones(len(tokens), np.float32)
  else:
    mask = np.zeros(len(tokens), np.float32)
    mask[1 + len(context) :] = 1.0  # the copied key, its newline, EOS
  return tokens, mask
