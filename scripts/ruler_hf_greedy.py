r"""transformers' greedy decoding on the same RULER prompts an lctx eval scored.

Rebuilds the main cells' examples of a finished `--mode=eval` run from its
evals/metrics.json config (the same builder, seeds and tokenizer, so the same
prompt ids), decodes each with `model.generate(do_sample=False)` in transformers
(PyTorch, CPU), scores it with RULER's metric and sets it beside lctx's
generation score per cell. lctx stops a row once the answer is in (the same
score), so its text is a prefix of transformers' when both take the same argmaxes.

  python scripts/ruler_hf_greedy.py --workdir=/tmp/lctx/pretrained --hf_dir=/tmp/lctx/smollm2

Writes <workdir>/evals/hf_greedy.json and prints one line per cell.
"""

import argparse
import json
import os
import time

import numpy as np


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--hf_dir", required=True)
  args = parser.parse_args()

  import torch
  from transformers import AutoModelForCausalLM

  from lctx.data.tokenizers import HFTokenizer
  from lctx.evals import ruler
  from lctx.evals.prompts import build_text_example, make_text_haystack
  from lctx.evals.tasks import eval_seed

  with open(os.path.join(args.workdir, "evals", "metrics.json")) as f:
    cfg = json.load(f)["config"]
  with open(os.path.join(args.workdir, "evals", "retrieval.json")) as f:
    records = json.load(f)
  if cfg["prompts"] != "ruler" or cfg["haystack"] == "text":
    raise SystemExit("error: this script rebuilds 'ruler' prompts on a noise or needle haystack.")
  tok = HFTokenizer(args.hf_dir)
  model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
  haystack = make_text_haystack(cfg["haystack"])
  budget = cfg["generation_tokens"]
  reserve = min(budget, max(ruler.TOKENS_TO_GENERATE.values()))
  out, t_total, n_total = [], 0.0, 0
  per_length = {}  # length -> [seconds, examples, generated tokens]
  for length in cfg["lengths"]:
    timing = per_length.setdefault(int(length), [0.0, 0, 0])
    for task in cfg["tasks"]:
      depths = [None] if task in ruler.DEPTHLESS else cfg["depths"]
      for di, depth in enumerate(depths):
        scores, texts = [], []
        for s in range(cfg["samples_per_cell"]):
          ex = build_text_example(
            task,
            length,
            depth,
            eval_seed(cfg["seed"], "main", task, length, di, s),
            tok,
            haystack,
            add_bos=cfg["add_bos"],
            kinds=tuple(cfg["needle_kinds"]),
            reserve=reserve,
            chat=cfg["chat"],
          )
          ids = torch.tensor(np.asarray(ex.tokens[: ex.answer_start])[None], dtype=torch.long)
          t0 = time.perf_counter()
          with torch.no_grad():
            gen = model.generate(
              ids,
              attention_mask=torch.ones_like(ids),
              max_new_tokens=min(budget, ex.max_new_tokens),
              do_sample=False,
              eos_token_id=tok.eos_id,
              pad_token_id=tok.pad_id,
            )
          seconds = time.perf_counter() - t0
          t_total += seconds
          n_total += 1
          timing[0] += seconds
          timing[1] += 1
          timing[2] += int(gen.shape[1] - ids.shape[1])
          text = tok.decode(gen[0, ids.shape[1] :].tolist())
          scores.append(ruler.example_score(text, ex.answer_items, ex.metric))
          texts.append(text)
        rec = next(
          (
            r
            for r in records
            if r["task"] == task
            and r["length"] == length
            and r["depth"] == depth
            and not r["needle_removed"]
            and not r["held_out"]
          ),
          {},
        )
        row = {
          "task": task,
          "length": length,
          "depth": depth,
          "hf_generation_score": float(np.mean(scores)),
          "lctx_generation_score": rec.get("generation_score"),
          "lctx_accuracy": rec.get("accuracy"),
          "hf_generation": texts[0][:200],
          "lctx_generation": rec.get("generation"),
        }
        out.append(row)
        print(
          f"{task} {length} depth {depth}: transformers greedy {row['hf_generation_score']:.2f}, "
          f"lctx greedy {row['lctx_generation_score']}, lctx teacher-forced "
          f"{row['lctx_accuracy']} | hf {texts[0][:60]!r} | lctx {str(rec.get('generation'))[:60]!r}",
          flush=True,
        )
  summary = {
    "cells": out,
    "hf_seconds_per_example": t_total / max(1, n_total),
    "hf_by_length": {
      str(n): {"seconds_per_example": t / max(1, k), "examples": k, "generated_tokens": g}
      for n, (t, k, g) in per_length.items()
    },
  }
  with open(os.path.join(args.workdir, "evals", "hf_greedy.json"), "w") as f:
    json.dump(summary, f, indent=1)
  for n, (t, k, g) in per_length.items():
    print(f"transformers at {n}: {t / max(1, k):.1f} s per example ({k} examples, {g} tokens)")
  print(f"transformers: {t_total:.1f} s for {n_total} examples")


if __name__ == "__main__":
  main()
