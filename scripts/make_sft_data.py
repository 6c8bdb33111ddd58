r"""Synthetic long-context conversations for the CPU SFT recipe (gin/local_cpu_sft.gin).

    python scripts/make_sft_data.py --out=/tmp/lctx/sft_data

Writes under --out:
  tokenizer/   a byte-level tokenizer.json with the byte tokenizer's ids (pad 0,
               bos 1, eos 2, byte b -> b + 3) plus <|im_start|> 259 and
               <|im_end|> 260, and a ChatML chat template, so a byte-level lctx
               checkpoint (gin/local_cpu.gin) can start the fine-tuning;
  train.jsonl, heldout.jsonl   rows {"messages": [...]} from disjoint seeds.

Each conversation: a system turn; the user pastes a document of `key: value`
lines and asks the assistant to keep it; the assistant says it has; the user
asks for one key's value; the assistant answers the value. The answer can
only be read from the document two turns earlier.
"""

from __future__ import annotations

import argparse
import json
import os
import string

import numpy as np

CHATML = (
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
  "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = "Answer from the document."


def conversation(rng: np.random.Generator, min_lines: int, max_lines: int) -> list[dict]:
  n = int(rng.integers(min_lines, max_lines + 1))
  keys = set()
  while len(keys) < n:
    keys.add("".join(rng.choice(list(string.ascii_lowercase), 3)))
  keys = sorted(keys, key=lambda _: rng.random())
  values = [f"{int(v):04d}" for v in rng.integers(0, 10_000, n)]
  doc = "\n".join(f"{k}: {v}" for k, v in zip(keys, values))
  asked = int(rng.integers(n))
  return [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": f"Keep this document.\n{doc}"},
    {"role": "assistant", "content": "Kept."},
    {"role": "user", "content": f"Value of {keys[asked]}?"},
    {"role": "assistant", "content": values[asked]},
  ]


def write_tokenizer(directory: str) -> str:
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top

  os.makedirs(directory, exist_ok=True)
  byte_chars = pre_tokenizers.ByteLevel.alphabet()
  # ByteLevel's byte -> printable-character table (GPT-2's bytes_to_unicode).
  table = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
  table += list(range(ord("®"), ord("ÿ") + 1))
  chars, extra = {b: chr(b) for b in table}, 0
  for b in range(256):
    if b not in chars:
      chars[b] = chr(256 + extra)
      extra += 1
  assert set(chars.values()) == set(byte_chars)
  vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {chars[b]: b + 3 for b in range(256)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"])
  assert tok.token_to_id("<|im_start|>") == 259 and tok.token_to_id("<|im_end|>") == 260
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"bos_token": "<bos>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
    f.write(CHATML)
  return directory


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="/tmp/lctx/sft_data")
  parser.add_argument("--train", type=int, default=20_000, help="training conversations")
  parser.add_argument("--heldout", type=int, default=200, help="held-out conversations")
  parser.add_argument("--min_lines", type=int, default=4)
  parser.add_argument("--max_lines", type=int, default=24)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  write_tokenizer(os.path.join(args.out, "tokenizer"))
  for name, count, seed in (("train", args.train, 0), ("heldout", args.heldout, 1)):
    rng = np.random.default_rng([seed, 0x5F7])
    with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
      for _ in range(count):
        messages = conversation(rng, args.min_lines, args.max_lines)
        f.write(json.dumps({"messages": messages}) + "\n")
  print(f"wrote {args.out}: tokenizer/, train.jsonl ({args.train}), heldout.jsonl ({args.heldout})")


if __name__ == "__main__":
  main()
