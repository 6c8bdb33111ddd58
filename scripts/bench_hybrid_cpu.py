r"""Step time of the 3:1 Gated DeltaNet hybrid against full attention of the same width, on CPU.

  python scripts/bench_hybrid_cpu.py --out=bench_results/bench_hybrid_cpu.json

Two models from gin/local_cpu_retrieval_hybrid.gin that differ only in
`ModelConfig.layer_types`: the file's (3 linear : 1 full, Gated DeltaNet) and
every layer full attention (same d_model, heads, num_layers, vocab). At each
length (tokens per step = one row of that length: batch 1, so the sequence is
the length) both are built, compiled and run one untimed warm-up step; then
`--rounds` interleaved rounds (hybrid, full, hybrid, full, ...) each time one
jitted training step (forward, backward, AdamW update) on the same random batch
(scripts/bench_setup.py), so machine load falls on both alike. Mesh: the file's
8 fake CPU devices as context 8 with all_gather (the recipe's strategy; batch 1
leaves no data axis); the linear layers exchange their per-shard state
summaries over the same axis (lctx/parallel/linear_context.py).

Prints a table (median and fastest step seconds per model, full / hybrid of
the medians, load average before and after each length) and writes JSON (--out).
Long lengths take few rounds: the full model's 32K step on 2 cores takes
minutes; the length is kept, the rounds are cut (--rounds per length).
"""

import json
import os
import platform
import subprocess
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_setup  # noqa: E402  (scripts/, beside this file)

GIN_FILE = "gin/local_cpu_retrieval_hybrid.gin"

flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Tokens per step (batch 1 x length).")
flags.DEFINE_list("rounds", ["3", "2", "1"], "Interleaved rounds at each length.")
flags.DEFINE_multi_string("gin_param", [], "Extra gin bindings (for both models).")
flags.DEFINE_string("out", "bench_results/bench_hybrid_cpu.json", "JSON output.")
FLAGS = flags.FLAGS

MESH = ["MeshConfig.data = 1", "MeshConfig.context = 8", "TrainConfig.batch_size = 1"]


def _models(num_layers: int) -> dict[str, list[str]]:
  """The gin bindings of each model beyond the file's (hybrid: none)."""
  full = ", ".join(["'full_attention'"] * num_layers)
  return {"hybrid": [], "full": [f"ModelConfig.layer_types = ({full},)"]}


def _nproc() -> int:
  try:
    return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
  except (OSError, ValueError, subprocess.CalledProcessError):
    return os.cpu_count() or 0


def _num_layers(params) -> int:
  import gin  # pylint: disable=g-import-not-at-top

  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top

  gin.clear_config()
  gin_utils.parse([GIN_FILE], params, [bench_setup.ROOT])
  return configs.experiment().model.num_layers


def _build(params):
  """(experiment, trainer, state, device batch) of the file with params bound."""
  import gin  # pylint: disable=g-import-not-at-top

  gin.clear_config()
  exp, trainer, state = bench_setup.trainer_for([GIN_FILE], params)
  batch = trainer.device_batch(trainer.plan.to_device_order(bench_setup.random_batch(exp)))
  return exp, trainer, state, batch


def _write(rows, gin_params, devices) -> None:
  out = dict(
    gin_file=GIN_FILE,
    gin_params=gin_params,
    mesh="context 8 (all_gather), 8 fake CPU devices, batch 1",
    machine=f"{platform.node()} {platform.processor() or platform.machine()}, nproc {_nproc()}",
    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    devices=devices,
    lengths=rows,
  )
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=2)


def main(_):
  base = [*MESH, *FLAGS.gin_param]
  bench_setup.fake_devices([GIN_FILE], base)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  lengths = [int(n) for n in FLAGS.lengths]
  rounds = [int(r) for r in FLAGS.rounds]
  if len(rounds) != len(lengths):
    raise ValueError(f"--rounds needs one entry per length; got {rounds} for {lengths}")
  models = _models(_num_layers(base))
  rows = []
  for length, n_rounds in zip(lengths, rounds, strict=True):
    load_before = os.getloadavg()
    runs = {}
    for name, extra in models.items():
      exp, trainer, state, batch = _build([*base, f"TrainConfig.seq_len = {length}", *extra])
      t0 = time.perf_counter()
      state, m = trainer.train_step(state, batch)  # compile + warm-up
      jax.block_until_ready(m)
      runs[name] = dict(
        trainer=trainer,
        state=state,
        batch=batch,
        times=[],
        first_step_seconds=time.perf_counter() - t0,
        params=exp.model.num_params(),
        layer_types=list(exp.model.layer_types),
        loss_after_warmup=float(m["loss"]),
      )
    for _ in range(n_rounds):
      for run in runs.values():
        t0 = time.perf_counter()
        run["state"], m = run["trainer"].train_step(run["state"], run["batch"])
        jax.block_until_ready(m)
        run["times"].append(time.perf_counter() - t0)
    load_after = os.getloadavg()
    row = dict(tokens_per_step=length, rounds=n_rounds, load_before=load_before)
    row["load_after"] = load_after
    for name, run in runs.items():
      row[name] = dict(
        step_seconds_median=float(np.median(run["times"])),
        step_seconds_min=float(np.min(run["times"])),
        step_seconds=run["times"],
        first_step_seconds=run["first_step_seconds"],
        params=run["params"],
        layer_types=run["layer_types"],
        loss_after_warmup=run["loss_after_warmup"],
      )
    row["full_over_hybrid"] = (
      row["full"]["step_seconds_median"] / row["hybrid"]["step_seconds_median"]
    )
    rows.append(row)
    print(
      f"{length:>7} tokens: hybrid {row['hybrid']['step_seconds_median']:.3f} s "
      f"(min {row['hybrid']['step_seconds_min']:.3f}), full {row['full']['step_seconds_median']:.3f} s "
      f"(min {row['full']['step_seconds_min']:.3f}), full/hybrid {row['full_over_hybrid']:.2f}, "
      f"load {load_before[0]:.2f} -> {load_after[0]:.2f}",
      flush=True,
    )
    del runs
    _write(rows, base, jax.device_count())  # after every length: a cut-short run keeps its rows
  print()
  print(
    "| tokens/step | rounds | hybrid s/step (min) | full s/step (min) | full / hybrid | load 1-min before -> after |"
  )
  print("|---:|---:|---:|---:|---:|---|")
  for r in rows:
    h, f = r["hybrid"], r["full"]
    print(
      f"| {r['tokens_per_step']:,} | {r['rounds']} | {h['step_seconds_median']:.3f} "
      f"({h['step_seconds_min']:.3f}) | {f['step_seconds_median']:.3f} ({f['step_seconds_min']:.3f}) "
      f"| {r['full_over_hybrid']:.2f} | {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |"
    )


if __name__ == "__main__":
  app.run(main)
