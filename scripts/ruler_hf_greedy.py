r"""transformers' greedy decoding on the same RULER prompts an lctx eval scored.

Rebuilds the main cells' examples of a finished `--mode=eval` run from its
evals/metrics.json config (the same builder, seeds and tokenizer, so the same
prompt ids) and sets transformers' (PyTorch, CPU) greedy decoding beside lctx's,
per example, scored with RULER's metric.

--mode=verify (default; needs the run's per-example `generated_ids`): one torch
forward of prompt + lctx's decoded tokens. transformers' greedy decoding equals
lctx's exactly when every argmax there equals the next lctx token and lctx's
stop is transformers' too: the budget, every reference in the text (RULER's
string match: what follows cannot change the score), or EOS as the argmax after
the last token. Where they differ, transformers' `generate` continues from the
first differing position, and both texts are reported.
--mode=generate: `model.generate(do_sample=False)` from the prompt, per example
(transformers runs to its budget or EOS; lctx stops once the answer is in, so
its text is a prefix of transformers' when both take the same argmaxes).

  python scripts/ruler_hf_greedy.py --workdir=/tmp/lctx/pretrained --hf_dir=/tmp/lctx/smollm2

Writes <workdir>/evals/hf_greedy.json and prints one line per cell.
"""

import argparse
import json
import os
import time

import numpy as np


def _examples(cfg, tok, length, task, di, depth):
  from lctx.evals import ruler
  from lctx.evals.prompts import build_text_example, make_text_haystack
  from lctx.evals.tasks import eval_seed

  reserve = min(cfg["generation_tokens"], max(ruler.TOKENS_TO_GENERATE.values()))
  haystack = make_text_haystack(cfg["haystack"])
  return [
    build_text_example(
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
    for s in range(cfg["samples_per_cell"])
  ]


def _generate(model, tok, ids, budget):
  import torch

  x = torch.tensor([ids], dtype=torch.long)
  with torch.no_grad():
    gen = model.generate(
      x,
      attention_mask=torch.ones_like(x),
      max_new_tokens=budget,
      do_sample=False,
      eos_token_id=tok.eos_id,
      pad_token_id=tok.pad_id,
    )
  out = gen[0, x.shape[1] :].tolist()
  return out[: out.index(tok.eos_id)] if tok.eos_id in out else out


def _verify(model, tok, prompt, lctx_ids, budget, refs):
  """(first differing index or None, why lctx's stop holds) from one forward."""
  import torch

  x = torch.tensor([list(prompt) + list(lctx_ids)], dtype=torch.long)
  with torch.no_grad():
    logits = model(x).logits[0]
  p, n = len(prompt), len(lctx_ids)
  top = logits[p - 1 : p + n].argmax(-1).tolist()
  for j in range(n):
    if top[j] != lctx_ids[j]:
      return j, "argmax"
  if n >= budget:
    return None, "budget"
  text = tok.decode(list(lctx_ids)).lower()
  if refs and all(r.lower() in text for r in refs):
    return None, "references"
  return (None, "eos") if top[n] == tok.eos_id else (n, "after the last token")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--hf_dir", required=True)
  parser.add_argument("--mode", choices=("verify", "generate"), default="verify")
  args = parser.parse_args()

  import torch
  from transformers import AutoModelForCausalLM

  from lctx.data.tokenizers import HFTokenizer
  from lctx.evals import ruler

  with open(os.path.join(args.workdir, "evals", "metrics.json")) as f:
    cfg = json.load(f)["config"]
  with open(os.path.join(args.workdir, "evals", "retrieval.json")) as f:
    records = json.load(f)
  if cfg["prompts"] != "ruler" or cfg["haystack"] == "text":
    raise SystemExit("error: this script rebuilds 'ruler' prompts on a noise or needle haystack.")
  tok = HFTokenizer(args.hf_dir)
  model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32).eval()
  out, disagreements = [], []
  per_length = {}  # length -> [seconds, examples, forwards, generate calls]
  for length in cfg["lengths"]:
    timing = per_length.setdefault(int(length), [0.0, 0, 0, 0])
    for task in cfg["tasks"]:
      depths = [None] if task in ruler.DEPTHLESS else cfg["depths"]
      for di, depth in enumerate(depths):
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
        if args.mode == "verify" and "generated_ids" not in rec:
          raise SystemExit(
            f"error: {task} at {length}, depth {depth}: the run's retrieval.json has no "
            "generated_ids (an older run): use --mode=generate."
          )
        scores, texts, agreed, stops = [], [], 0, []
        for s, ex in enumerate(_examples(cfg, tok, length, task, di, depth)):
          prompt = [int(t) for t in ex.tokens[: ex.answer_start]]
          budget = min(cfg["generation_tokens"], ex.max_new_tokens)
          t0 = time.perf_counter()
          if args.mode == "generate":
            ids = _generate(model, tok, prompt, budget)
            timing[3] += 1
          else:
            mine = rec["generated_ids"][s]
            j, why = _verify(model, tok, prompt, mine, budget, ex.answer_items)
            timing[2] += 1
            stops.append(why)
            ids = mine
            if j is None:
              agreed += 1
            else:
              ids = mine[:j] + _generate(model, tok, prompt + mine[:j], budget - j)
              timing[3] += 1
              disagreements.append(
                {
                  "task": task,
                  "length": length,
                  "depth": depth,
                  "sample": s,
                  "position": j,
                  "where": why,
                  "lctx": tok.decode(mine),
                  "transformers": tok.decode(ids),
                }
              )
          timing[0] += time.perf_counter() - t0
          timing[1] += 1
          text = tok.decode(ids)
          scores.append(ruler.example_score(text, ex.answer_items, ex.metric))
          texts.append(text)
        row = {
          "task": task,
          "length": length,
          "depth": depth,
          "hf_generation_score": float(np.mean(scores)),
          "lctx_generation_score": rec.get("generation_score"),
          "lctx_accuracy": rec.get("accuracy"),
          "hf_generations": [t[:200] for t in texts],
          "lctx_generations": rec.get("generations", [rec.get("generation")]),
        }
        if args.mode == "verify":
          row["agreed"] = agreed
          row["n"] = len(texts)
          # why lctx's decoding stopped (or where it first differs), per example
          row["stops"] = stops
        out.append(row)
        agree = f", agreed {agreed}/{len(texts)}" if args.mode == "verify" else ""
        print(
          f"{task} {length} depth {depth}: transformers greedy {row['hf_generation_score']:.2f}, "
          f"lctx greedy {row['lctx_generation_score']}, lctx teacher-forced "
          f"{row['lctx_accuracy']}{agree} | hf {texts[0][:60]!r} | "
          f"lctx {str(row['lctx_generations'][0])[:60]!r}",
          flush=True,
        )
  for d in disagreements:
    print(f"differs: {d}")
  summary = {
    "mode": args.mode,
    "cells": out,
    "disagreements": disagreements,
    "hf_by_length": {
      str(n): {
        "seconds_per_example": t / max(1, k),
        "examples": k,
        "verify_forwards": v,
        "generate_calls": g,
      }
      for n, (t, k, v, g) in per_length.items()
    },
  }
  if args.mode == "verify":
    summary["agreed"] = sum(r["agreed"] for r in out)
    summary["examples"] = sum(r["n"] for r in out)
  name = "hf_greedy.json" if args.mode == "verify" else "hf_greedy_generate.json"
  with open(os.path.join(args.workdir, "evals", name), "w") as f:
    json.dump(summary, f, indent=1)
  for n, (t, k, v, g) in per_length.items():
    print(
      f"transformers at {n}: {t / max(1, k):.2f} s per example ({k} examples, {v} verify forwards, {g} generate calls)"
    )
  if args.mode == "verify":
    print(f"transformers' greedy = lctx's on {summary['agreed']} of {summary['examples']} examples")


if __name__ == "__main__":
  main()
