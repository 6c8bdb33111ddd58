r"""Steady-state training throughput of a gin experiment.

  python scripts/bench_train.py --gin_file=gin/bench/maxtext_cpu_peer.gin

Times `--steps` train steps after `--warmup` (compile excluded) on random-token
batches of the experiment's shape (every token real: no padding), and reports
tokens/s and model FLOP/s (`ModelConfig.flops_per_token`) as a fraction of a 2048^3
matmul timed in the same run on the same devices. Prints a table and writes
JSON (--out).
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
flags.DEFINE_integer("steps", 5, "Timed steps.")
flags.DEFINE_integer("warmup", 2, "Untimed steps after compile.")
flags.DEFINE_string("out", "bench_results/bench_train.json", "JSON output.")
FLAGS = flags.FLAGS


def main(_):
  bench_setup.fake_devices(FLAGS.gin_file, FLAGS.gin_param)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lctx import metrics  # pylint: disable=g-import-not-at-top

  exp, trainer, state = bench_setup.trainer_for(FLAGS.gin_file, FLAGS.gin_param)
  b, t = exp.train.batch_size, exp.train.seq_len
  batch = bench_setup.random_batch(exp)
  batch = trainer.plan.to_device_order(batch)
  dev_batch = trainer.device_batch(batch)
  t0 = time.perf_counter()
  compiled = trainer.compile_train_step()
  compile_s = time.perf_counter() - t0
  for _ in range(FLAGS.warmup):
    state, m = trainer.train_step(state, dev_batch)
  jax.block_until_ready(m)
  times = []
  for _ in range(FLAGS.steps):
    t0 = time.perf_counter()
    state, m = trainer.train_step(state, dev_batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  # Baseline in the same run, after the steps (same machine state); best of
  # 10, so a dip of the shared machine cannot flatter the fraction.
  matmul = metrics.measure_matmul_flops(repeats=10)
  flops_step = exp.model.flops_per_token(t, causal=True) * b * t
  result = {
    "gin_files": FLAGS.gin_file,
    "gin_params": FLAGS.gin_param,
    "machine": f"{platform.node()} {os.cpu_count()} cpus "
    f"{jax.devices()[0].device_kind} x{jax.device_count()}",
    "strategy": trainer.strategy,
    "load_balance": trainer.load_balance,
    "attention_backend": exp.train.attention_options.backend,
    # What the compiled step really calls (auto may fall back to blockwise).
    "fused_cpu_attention": "lctx_cpu_attention_fwd" in compiled.as_text(),
    "tokens_per_step": b * t,
    "compile_s": compile_s,
    "step_s_median": step_s,
    "step_s_all": times,
    "tokens_per_sec": b * t / step_s,
    "model_flops_per_step": flops_step,
    "model_gflops_per_sec": flops_step / step_s / 1e9,
    "matmul_2048_gflops_per_sec": matmul / 1e9,
    "fraction_of_matmul": flops_step / step_s / matmul,
    "memory": metrics.compiled_memory(compiled),
    "final_loss": float(jax.device_get(m["loss"])),
  }
  print(
    f"{'experiment':<40} {'tok/s':>9} {'model GFLOP/s':>14} {'matmul GFLOP/s':>15} {'fraction':>9}"
  )
  print(
    f"{','.join(FLAGS.gin_file):<40} {result['tokens_per_sec']:>9.0f} "
    f"{result['model_gflops_per_sec']:>14.1f} "
    f"{result['matmul_2048_gflops_per_sec']:>15.1f} "
    f"{result['fraction_of_matmul']:>9.1%}"
  )
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=2)
  print("wrote", FLAGS.out)


if __name__ == "__main__":
  app.run(main)
