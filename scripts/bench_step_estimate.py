r"""The step-time estimate of `--mode=compile` against a measured CPU step.

  python scripts/bench_step_estimate.py --gin_file=gin/local_cpu.gin
  python scripts/bench_step_estimate.py --gin_file=gin/bench/maxtext_cpu_peer.gin

Compiles the experiment's train step for this machine's CPU devices, counts its
FLOPs and bytes from the compiled HLO as `--mode=compile` does
(`lctx.sizing.compile.step_figures`: dense matmuls + attention from the kernels' block
maps, loops at their trip counts), and takes as peak the 2048^3 matmul measured
in the same run, shared by the fake devices (as the trainer's MFU does). Then
times `--steps` steps on random-token batches of the experiment's shape and
reports measured / lower bound (the FLOP bound: CPU "collectives" are memory
copies, not counted) and measured / estimate. Prints a table and writes JSON.
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
flags.DEFINE_string("out", "bench_results/bench_step_estimate.json", "JSON output.")
FLAGS = flags.FLAGS


def main(_):
  bench_setup.fake_devices(FLAGS.gin_file, FLAGS.gin_param)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lctx import hardware, metrics  # pylint: disable=g-import-not-at-top
  from lctx.sizing import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from lctx.sizing import hlo_flops  # pylint: disable=g-import-not-at-top

  exp, trainer, state = bench_setup.trainer_for(FLAGS.gin_file, FLAGS.gin_param)
  b, t = exp.train.batch_size, exp.train.seq_len
  batch = bench_setup.random_batch(exp)
  dev_batch = trainer.device_batch(trainer.plan.to_device_order(batch))
  compiled = trainer.compile_train_step()
  count = hlo_flops.matmul_flops(compiled.as_text())
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
  # The peak in the same run, after the steps; best of 10 (as bench_train.py).
  matmul = metrics.measure_matmul_flops(repeats=10)
  devices = jax.device_count()
  # The CPU as an accelerator row: its devices share the cores; no link figures.
  cpu = hardware.Accelerator("cpu", 0, 1, devices, 0, matmul, "cpu")
  fig = compile_lib.step_figures(
    count, mesh=trainer.mesh, accel=cpu, model=exp.model, train=exp.train,
    peak_flops_per_device=matmul / devices,
  )  # fmt: skip
  result = {
    "gin_files": FLAGS.gin_file,
    "gin_params": FLAGS.gin_param,
    "machine": f"{platform.node()} {os.cpu_count()} cpus {jax.devices()[0].device_kind} x{devices}",
    "strategy": trainer.strategy,
    "attention_backend": compile_lib.attention_backend_of(
      compiled.as_text(), exp.train.attention_options.backend
    ),
    "tokens_per_step": b * t,
    "matmul_2048_gflops_per_sec": matmul / 1e9,
    "step_s_median": step_s,
    "step_s_all": times,
    "unknown_trip_count_loops": count["unknown_trip_count_loops"],
    **{k: v for k, v in fig.items() if k != "step_time_label"},
    "measured_over_lower_bound": step_s / fig["step_seconds_lower_bound"],
    "measured_over_estimate": step_s / fig["step_seconds_estimate"],
  }
  print(
    f"{'experiment':<36} {'total GFLOP/dev':>15} {'recompute':>9} {'bound s':>8} "
    f"{'estimate s':>10} {'measured s':>10} {'meas/bound':>10}"
  )
  print(
    f"{','.join(FLAGS.gin_file):<36} {fig['total_flops_per_device'] / 1e9:>15.2f} "
    f"{fig['recompute_ratio']:>9.3f} {fig['step_seconds_lower_bound']:>8.3f} "
    f"{fig['step_seconds_estimate']:>10.3f} {step_s:>10.3f} "
    f"{result['measured_over_lower_bound']:>10.2f}"
  )
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(result, f, indent=2)
  print("wrote", FLAGS.out)


if __name__ == "__main__":
  app.run(main)
