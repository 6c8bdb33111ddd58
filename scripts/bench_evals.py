r"""Eval-step throughput next to the train step's, in one run on the same devices.

  python scripts/bench_evals.py --gin_file=gin/local_cpu.gin

Times `--steps` calls of each after `--warmup` (compile excluded), on one batch
of the experiment's shape (batch_size x seq_len random tokens, all real):
- train: Trainer.train_step (forward, backward, AdamW update);
- eval: Trainer.score_fn, the in-program eval step as the evals call it, host
  to host (natural-order rows in, device order, per-process rows, answer
  scores of --answer_tokens positions per row and the position-loss bucket
  sums out);
- host_logits: the path it replaced (Trainer.logits_fn, full float32 logits to
  the host, scored there by lctx.evals.scoring.logits_scorer).
A forward pass is about a third of a train step, so the eval step should reach
at least 2x the train step's tokens/s. Prints a table and writes JSON (--out).
"""

import json
import os
import platform
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_setup  # noqa: E402  (scripts/, beside this file)

flags.DEFINE_multi_string("gin_file", [], "Gin files.")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings.")
flags.DEFINE_integer("steps", 5, "Timed calls of each step.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compile.")
flags.DEFINE_integer("answer_tokens", 16, "Scored positions per row (the last ones).")
flags.DEFINE_string("out", "bench_results/bench_evals.json", "JSON output.")
FLAGS = flags.FLAGS


def _time(fn, steps, warmup):
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def main(_):
  bench_setup.fake_devices(FLAGS.gin_file, FLAGS.gin_param)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lctx.evals import scoring  # pylint: disable=g-import-not-at-top
  from lctx.evals.context_use import position_buckets  # pylint: disable=g-import-not-at-top

  exp, trainer, state = bench_setup.trainer_for(FLAGS.gin_file, FLAGS.gin_param)
  b, t = exp.train.batch_size, exp.train.seq_len
  batch = bench_setup.random_batch(exp)
  train_batch = trainer.device_batch(trainer.plan.to_device_order(batch))
  rows = list(batch["inputs"])
  mask = np.zeros(t, bool)
  mask[-FLAGS.answer_tokens :] = True
  bucket = np.full(t, -1, np.int32)
  for k, (start, end) in enumerate(position_buckets(t)):
    bucket[start:end] = k
  score_batch = scoring.make_score_batch(rows, [mask] * b, batch_size=b, buckets=[bucket] * b)

  t0 = time.perf_counter()
  trainer.compile_train_step()
  compile_train_s = time.perf_counter() - t0
  holder = {"state": state}

  def train():
    holder["state"], m = trainer.train_step(holder["state"], train_batch)
    jax.block_until_ready(m)

  eval_state = trainer.init_state(1)  # the train step donates `state`
  score = trainer.score_fn(eval_state)
  host = scoring.logits_scorer(trainer.logits_fn(eval_state))
  t0 = time.perf_counter()
  score(score_batch)
  compile_eval_s = time.perf_counter() - t0
  results = {}
  for name, fn in (
    ("train", train),
    ("eval", lambda: score(score_batch)),
    ("host_logits", lambda: host(score_batch)),
  ):
    times = _time(fn, FLAGS.steps, FLAGS.warmup)
    med = float(np.median(times))
    results[name] = {"step_s_median": med, "step_s_all": times, "tokens_per_sec": b * t / med}
  a, h = score(score_batch), host(score_batch)
  result = {
    "gin_files": FLAGS.gin_file,
    "gin_params": FLAGS.gin_param,
    "machine": f"{platform.node()} {os.cpu_count()} cpus "
    f"{jax.devices()[0].device_kind} x{jax.device_count()}",
    "strategy": trainer.strategy,
    "load_balance": trainer.load_balance,
    "tokens_per_step": b * t,
    "answer_tokens_per_row": FLAGS.answer_tokens,
    "compile_train_s": compile_train_s,
    "compile_eval_s": compile_eval_s,
    **{f"{k}_{m}": v[m] for k, v in results.items() for m in v},
    "eval_over_train": results["eval"]["tokens_per_sec"] / results["train"]["tokens_per_sec"],
    "host_logits_over_train": results["host_logits"]["tokens_per_sec"]
    / results["train"]["tokens_per_sec"],
    "max_abs_logp_diff_vs_host": float(np.max(np.abs(a["logp"] - h["logp"]))),
  }
  print(f"{'step':<12} {'tok/s':>10} {'x train':>8}")
  for name in results:
    tps = results[name]["tokens_per_sec"]
    print(f"{name:<12} {tps:>10.0f} {tps / results['train']['tokens_per_sec']:>8.2f}")
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=2)
  print("wrote", FLAGS.out)


if __name__ == "__main__":
  app.run(main)
