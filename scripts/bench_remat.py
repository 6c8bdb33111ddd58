r"""Remat policies against each other on one gin experiment, interleaved in one run.

  python scripts/bench_remat.py --gin_file=gin/local_cpu.gin \
      --policy=full --policy=save_attention_out

Builds one Trainer per `ModelConfig.remat_policy` (same seed, same random batch,
scripts/bench_setup.py), compiles each, and reports per policy: the compiled
program's matmul FLOPs per device against the trainer's formula (the
`recompute_ratio` of `--mode=compile`: lctx/sizing/hlo_flops.py on the
optimised HLO, here of the CPU program), and the median step time over `--rounds`
rounds in which every policy runs `--steps` timed steps in turn (so machine load
falls on all of them alike). Prints a table and writes JSON (--out).
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
flags.DEFINE_multi_string("gin_param", [], "Gin bindings (for every policy).")
flags.DEFINE_multi_string("policy", ["full", "save_attention_out"], "Remat policies.")
flags.DEFINE_integer("steps", 3, "Timed steps per policy per round.")
flags.DEFINE_integer("rounds", 4, "Interleaved rounds.")
flags.DEFINE_integer("warmup", 1, "Untimed steps after compile.")
flags.DEFINE_string("out", "bench_results/bench_remat.json", "JSON output.")
FLAGS = flags.FLAGS


def main(_):
  bench_setup.fake_devices(FLAGS.gin_file, FLAGS.gin_param)
  import gin  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lctx.sizing import hlo_flops  # pylint: disable=g-import-not-at-top

  runs = {}
  for policy in FLAGS.policy:
    gin.clear_config()  # one experiment per policy
    params = [*FLAGS.gin_param, f"ModelConfig.remat_policy='{policy}'"]
    exp, trainer, state = bench_setup.trainer_for(FLAGS.gin_file, params)
    batch = trainer.device_batch(trainer.plan.to_device_order(bench_setup.random_batch(exp)))
    t0 = time.perf_counter()
    count = hlo_flops.matmul_flops(trainer.lower_train_step().compile().as_text())
    compile_s = time.perf_counter() - t0
    b, t = exp.train.batch_size, exp.train.seq_len
    model = exp.model.flops_per_token(t, causal=True) * b * t / jax.device_count()
    total = count["dense_flops"] + count["attention_flops"]
    for _ in range(FLAGS.warmup):
      state, m = trainer.train_step(state, batch)
    jax.block_until_ready(m)
    runs[policy] = dict(
      trainer=trainer,
      state=state,
      batch=batch,
      times=[],
      record=dict(
        remat_policy=policy,
        compile_seconds=compile_s,
        attention_flops_per_device=count["attention_flops"],
        dense_flops_per_device=count["dense_flops"],
        total_flops_per_device=total,
        model_flops_per_device=model,
        recompute_ratio=total / model,
        loss_after_warmup=float(m["loss"]),
      ),
    )
  for _ in range(FLAGS.rounds):
    for run in runs.values():
      for _ in range(FLAGS.steps):
        t0 = time.perf_counter()
        run["state"], m = run["trainer"].train_step(run["state"], run["batch"])
        jax.block_until_ready(m)
        run["times"].append(time.perf_counter() - t0)
  base = None
  rows = []
  for run in runs.values():
    rec = run["record"]
    rec["step_seconds_median"] = float(np.median(run["times"]))
    rec["step_seconds_min"] = float(np.min(run["times"]))
    rec["steps_timed"] = len(run["times"])
    base = base or rec["step_seconds_median"]
    rec["speedup_vs_first"] = base / rec["step_seconds_median"]
    rows.append(rec)
  out = dict(
    gin_files=FLAGS.gin_file,
    gin_params=FLAGS.gin_param,
    machine=f"{platform.node()} {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} cores",
    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    devices=jax.device_count(),
    rounds=FLAGS.rounds,
    steps_per_round=FLAGS.steps,
    policies=rows,
  )
  print(f"{'policy':<24} {'ratio':>6} {'median s':>9} {'min s':>8} {'speed-up':>8}")
  for r in rows:
    print(
      f"{r['remat_policy']:<24} {r['recompute_ratio']:6.3f} {r['step_seconds_median']:9.3f} "
      f"{r['step_seconds_min']:8.3f} {r['speedup_vs_first']:8.3f}"
    )
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  app.run(main)
