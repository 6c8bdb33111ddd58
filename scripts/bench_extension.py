r"""The context-extension comparison: RoPE methods zero-shot and after a fine-tune.

From one stage-1 checkpoint (a gin/local_cpu_retrieval.gin run at 512 tokens),
each method runs gin/local_cpu_extension.gin with its own RoPE setting:
  zero-shot  --mode=eval on the stage-1 parameters (no training), grid at 512 and 2048;
  fine-tune  --mode=train_and_eval: the extension stage (TrainConfig.steps at 2048), then
             the same grid at its last step.
Methods: none (the base unchanged), linear (position interpolation), yarn,
theta (a theta increase, NTK-aware: theta x factor^(H / (H - 2))), llama3.
Each run has its own workdir under --out; the rows (accuracy per task and length,
needle-removed accuracy, steps, wall seconds) go to <out>/bench_extension.json
and print as a markdown table. A run whose evals/retrieval.json exists is read,
not rerun (delete its workdir to rerun it).

  python scripts/bench_extension.py --base=/tmp/lctx/retrieval --out=/tmp/lctx/bench_ext
  python scripts/bench_extension.py --base=/tmp/lctx/retrieval --out=/tmp/lctx/bench_ext \
    --finetune=yarn,none --gin_param="TrainConfig.steps=300"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN_FILE = "gin/local_cpu_extension.gin"
FACTOR = 4.0
TRAINED_LENGTH = 512
HEAD_DIM = 32  # gin/models/tiny.gin
BASE_THETA = 10000.0
NTK_THETA = BASE_THETA * FACTOR ** (HEAD_DIM / (HEAD_DIM - 2))


def _scaling(**rope):
  return f"ModelConfig.rope_scaling = {rope!r}"


METHODS = {
  "none": ["ModelConfig.rope_scaling = None"],
  "linear": [_scaling(rope_type="linear", factor=FACTOR)],
  "yarn": [
    _scaling(rope_type="yarn", factor=FACTOR, original_max_position_embeddings=TRAINED_LENGTH)
  ],
  "theta": ["ModelConfig.rope_scaling = None", f"ModelConfig.rope_theta = {NTK_THETA:.1f}"],
  "llama3": [
    _scaling(
      rope_type="llama3",
      factor=FACTOR,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=TRAINED_LENGTH,
    )
  ],
}


def _run(name, mode, workdir, params, base, log):
  """One main.py run; returns its wall seconds (None when it was already done)."""
  if os.path.isfile(os.path.join(workdir, "evals", "retrieval.json")):
    return None
  cmd = [
    sys.executable,
    os.path.join(ROOT, "main.py"),
    f"--mode={mode}",
    f"--gin_file={GIN_FILE}",
    f"--workdir={workdir}",
    f"--gin_param=BASE_WORKDIR = '{base}'",
  ] + [f"--gin_param={p}" for p in params]
  print(f"[{name}] {' '.join(cmd)}", flush=True)
  start = time.time()
  with open(log, "w") as f:
    subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
  return time.time() - start


def _steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return 0
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  return max((r["step"] for r in rows if "loss" in r), default=0)


def _row(method, stage, workdir, wall):
  with open(os.path.join(workdir, "evals", "retrieval.json")) as f:
    records = json.load(f)
  row = {"method": method, "stage": stage, "steps": _steps(workdir), "wall_s": wall}
  for task in sorted({r["task"] for r in records}):
    rs = [r for r in records if r["task"] == task]
    main = [r for r in rs if not r["needle_removed"] and not r["held_out"]]
    removed = [r for r in rs if r["needle_removed"]]
    for length in sorted({r["length"] for r in main}):
      at = [r["accuracy"] for r in main if r["length"] == length]
      row[f"{task}/min_len{length}"] = min(at)
      row[f"{task}/mean_len{length}"] = sum(at) / len(at)
    if removed:
      row[f"{task}/removed_max"] = max(r["accuracy"] for r in removed)
      row[f"{task}/chance"] = max(r["chance"] for r in removed)
  return row


def _table(rows):
  tasks = sorted({k.split("/")[0] for r in rows for k in r if "/min_len" in k})
  lengths = sorted({int(k.rsplit("len", 1)[1]) for r in rows for k in r if "/min_len" in k})
  head = ["method", "stage", "steps", "wall"]
  head += [f"{t[:6]} {L} min/mean" for t in tasks for L in lengths]
  head += [f"{t[:6]} removed" for t in tasks]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    wall = "-" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min"
    cells = [r["method"], r["stage"], str(r["steps"]), wall]
    for t in tasks:
      for L in lengths:
        lo, mean = r.get(f"{t}/min_len{L}"), r.get(f"{t}/mean_len{L}")
        cells.append("-" if lo is None else f"{lo:.2f} / {mean:.2f}")
    cells += [f"{r.get(f'{t}/removed_max', float('nan')):.2f}" for t in tasks]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--base", required=True, help="stage-1 workdir or checkpoint step dir")
  parser.add_argument("--out", required=True, help="directory of the runs and the JSON")
  parser.add_argument("--zeroshot", default=",".join(METHODS), help="methods to eval zero-shot")
  parser.add_argument("--finetune", default=",".join(METHODS), help="methods to fine-tune")
  parser.add_argument(
    "--gin_param", action="append", default=[], help="extra bindings for every run (repeatable)"
  )
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  json_path = os.path.join(args.out, "bench_extension.json")
  rows = []
  if os.path.isfile(json_path):
    with open(json_path) as f:
      rows = json.load(f)
  plan = [("zero-shot", m) for m in args.zeroshot.split(",") if m]
  plan += [("fine-tune", m) for m in args.finetune.split(",") if m]
  for stage, method in plan:
    if method not in METHODS:
      raise SystemExit(f"unknown method {method!r}; one of {sorted(METHODS)}")
    tag = f"{'zeroshot' if stage == 'zero-shot' else 'finetune'}_{method}"
    workdir = os.path.join(args.out, tag)
    mode = "eval" if stage == "zero-shot" else "train_and_eval"
    wall = _run(tag, mode, workdir, METHODS[method] + args.gin_param, args.base, workdir + ".log")
    old = [r for r in rows if (r["method"], r["stage"]) == (method, stage)]
    if wall is None and old:
      continue
    row = _row(method, stage, workdir, wall)
    row["gin_params"] = METHODS[method] + args.gin_param
    rows = [r for r in rows if (r["method"], r["stage"]) != (method, stage)] + [row]
    with open(json_path, "w") as f:
      json.dump(rows, f, indent=1)
  print(_table(rows))
  print(f"wrote {json_path}")


if __name__ == "__main__":
  main()
