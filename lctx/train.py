"""The research loop: train, evaluate, checkpoint, resume.

`run(mode, workdir, experiment)` is what main.py calls. Modes:
  train           train to `TrainConfig.steps`, resuming from the latest
                  checkpoint in the workdir (a fresh workdir starts from
                  `TrainConfig.init_params_from` when set);
  eval            evaluate the latest checkpoint (held-out loss + retrieval),
                  or on a fresh workdir the `init_params_from` parameters;
  train_and_eval  train, then evaluate;
  inspect_data    print packing statistics of the training stream.
main.py dispatches the other modes to their own entry points: compile
(lctx/sizing/compile.py run_compile), plan (lctx/sizing/planner.py run_plan) and
export_hf (lctx/export.py run_export_hf).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from lctx import checkpoint as ckpt_lib
from lctx import data as data_lib
from lctx import errors, init_from, models
from lctx import metrics as metrics_lib
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig, Trainer

MODES = ("train", "eval", "train_and_eval", "inspect_data")


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything one run needs; bound by gin in lctx/configs.py."""

  model: models.ModelConfig
  data: data_lib.DataConfig
  train: TrainConfig = TrainConfig()
  mesh: mesh_lib.MeshConfig = mesh_lib.MeshConfig()
  evals: Any = None  # lctx.evals.EvalConfig or None


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------
def make_data_iterator(exp: Experiment, trainer: Trainer | None, split: str, seed: int):
  """Per-host iterator of the batch contract, reordered when load balancing."""
  # Rows go to the devices in the order the context plan holds them (zigzag
  # when load balancing), reordered once here on the host.
  transform = None
  if trainer is not None and trainer.plan.load_balance:

    def transform(batch):
      return trainer.plan.to_device_order({k: np.asarray(v) for k, v in batch.items()})

  per_host = exp.train.batch_size // jax.process_count()
  return data_lib.make_iterator(
    exp.data,
    split=split,
    batch_size=per_host,
    seq_len=exp.train.seq_len,
    seed=seed,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    batch_transform=transform,
  )


# ----------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------
def evaluate_loss(exp: Experiment, trainer: Trainer, state) -> dict[str, float]:
  """Mean loss over `eval_batches` held-out batches (same batches each time)."""
  it = make_data_iterator(exp, trainer, "validation", seed=exp.train.seed + 1)
  total, weight = 0.0, 0.0
  for _ in range(exp.train.eval_batches):
    aux = jax.device_get(trainer.eval_step(state, trainer.device_batch(next(it))))
    total += float(aux["loss"]) * float(aux["tokens"])
    weight += float(aux["tokens"])
  return {"eval/loss": total / max(weight, 1.0), "eval/tokens": weight}


def evaluate_retrieval(
  exp: Experiment, trainer: Trainer, state, workdir: str, step: int, generate: bool = True
) -> dict[str, float]:
  """The retrieval evals; `generate` False skips the generation score
  (EvalConfig.generation_tokens: decoding costs a forward per token), as the
  evals during training do; the last step's and --mode=eval's run it."""
  if exp.evals is None:
    return {}
  from lctx import evals as evals_lib  # pylint: disable=g-import-not-at-top

  tokenizer = data_lib.make_tokenizer_for(exp.data)
  documents = data_lib.load_documents(exp.data, split="validation", limit=exp.evals.num_documents)
  # The eval step scores inside the sharded program (Trainer.score_fn): only
  # answer scores and per-bucket loss sums reach the host.
  return evals_lib.run_evals(
    trainer.score_fn(state),
    tokenizer,
    config=exp.evals,
    workdir=workdir,
    step=step,
    documents=documents,
    attention_windows=exp.model.layer_windows,
    generate=generate,
  )


# ----------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------
class NonFiniteStepsError(RuntimeError):
  """Too many consecutive steps had a non-finite loss or gradient norm."""


class _SkippedSteps:
  """Counts the steps the trainer skipped as non-finite; raises after `limit` in a row.

  A step's flag is read once the next step is queued (no wait on the device),
  or at once where the loop syncs anyway (`resolve(everything=True)`).
  """

  def __init__(self, limit: int, checkpointer: ckpt_lib.Checkpointer):
    if limit < 1:
      raise ValueError(f"TrainConfig.max_skipped_steps must be >= 1; got {limit}.")
    self.limit, self.checkpointer = limit, checkpointer
    self.total, self.in_row, self._pending = 0, 0, []

  def add(self, step: int, flag) -> None:
    self._pending.append((step, flag))

  def resolve(self, everything: bool = False) -> None:
    while len(self._pending) > (0 if everything else 1):
      step, flag = self._pending.pop(0)
      if not int(jax.device_get(flag)):
        self.in_row = 0
        continue
      self.total += 1
      self.in_row += 1
      logging.warning(
        "step %d: non-finite loss or gradient norm; the update was skipped (%d in a row).",
        step,
        self.in_row,
      )
      if self.in_row >= self.limit:
        self.checkpointer.wait()
        raise NonFiniteStepsError(
          f"{self.in_row} consecutive steps ({step - self.in_row + 1}..{step}) had a "
          f"non-finite loss or gradient norm (TrainConfig.max_skipped_steps={self.limit}); "
          f"stopping. The last checkpoint, step {self.checkpointer.latest_step()} in "
          f"{self.checkpointer.directory}, was written before them and is intact."
        )


def checkpoint_before_input_error(
  err: errors.InputError, exp: Experiment, checkpointer, step: int, state, train_iter
) -> None:
  """Bad input met mid-training (a data row, a task file line): writes a
  checkpoint at the step reached, unless one exists or nothing was trained, and
  adds where it is to the error's one line; the caller re-raises."""
  checkpointer.wait()
  have = checkpointer.latest_step()
  if step > 0 and have != step:
    try:
      data_state = train_iter.get_state()
    except Exception:  # pylint: disable=broad-except  (the iterator may be what failed)
      data_state = None
    checkpointer.save(step, state, data_state, ckpt_lib.experiment_meta(exp), wait=True)
    have = step
  if have is not None:
    where = f"The run stopped at step {step}; the checkpoint at step {have} is in {checkpointer.directory}."
    err.args = (f"{err.args[0] if err.args else err} {where}",) + tuple(err.args[1:])


def train_loop(
  exp: Experiment,
  trainer: Trainer,
  state,
  train_iter,
  checkpointer: ckpt_lib.Checkpointer,
  writer,
  workdir: str,
  preemption: ckpt_lib.PreemptionWatch | None = None,
  profiler: metrics_lib.Profiler | None = None,
):
  """Trains to `steps`, or until a preemption notice (then checkpoints and
  returns early); returns (state, whether the last step evaluated)."""
  cfg = exp.train
  skipped = _SkippedSteps(cfg.max_skipped_steps, checkpointer)
  peak, peak_source = metrics_lib.peak_flops_per_device()
  logging.info("Peak FLOP/s per device: %.3g (%s)", peak, peak_source)
  t_compile = time.perf_counter()
  compiled = trainer.compile_train_step()
  memory = metrics_lib.compiled_memory(compiled)
  logging.info(
    "Train step compiled in %.1f s; per-device memory %s", time.perf_counter() - t_compile, memory
  )
  flops_per_token = exp.model.flops_per_token(cfg.seq_len, causal=True)
  n_devices = jax.device_count()
  step = int(jax.device_get(state["step"]))
  if step >= cfg.steps:
    logging.info("Nothing to train: step %d >= steps %d.", step, cfg.steps)
    return state, False
  logging.info(
    "Training %s from step %d to %d (%d tokens/step).",
    trainer.strategy,
    step,
    cfg.steps,
    cfg.batch_size * cfg.seq_len,
  )
  window_tokens, window_steps, t_window = 0.0, 0, time.perf_counter()
  metrics = None
  try:
    while step < cfg.steps:
      host_batch = next(train_iter)
      # Useful tokens: non-pad positions, counted on the host (no device sync).
      window_tokens += float(np.count_nonzero(host_batch["segment_ids"])) * (jax.process_count())
      if profiler is not None:
        profiler.before_step(step)
      state, metrics = trainer.train_step(state, trainer.device_batch(host_batch))
      step += 1
      window_steps += 1
      last = step == cfg.steps
      skipped.add(step, metrics["skipped"])
      # Every process gets the same answer at the same step.
      preempted = preemption is not None and preemption.reached(step)
      # Skipped steps are counted (and may stop the run) before anything is saved.
      skipped.resolve(everything=preempted or checkpointer.should_save(step, final=last))
      if profiler is not None:
        profiler.after_step(step, state)
      if step % cfg.log_every == 0 or last or preempted:
        metrics = jax.device_get(metrics)
        skipped.resolve(everything=True)
        elapsed = time.perf_counter() - t_window
        tps = window_tokens / elapsed
        tflops = flops_per_token * tps / n_devices / 1e12
        record = {
          # Summed over the step's loss-masked targets, divided by their count.
          "loss": float(metrics["loss"]),
          "supervised_tokens": float(metrics["tokens"]),
          "grad_norm": float(metrics["grad_norm"]),
          "learning_rate": float(metrics["learning_rate"]),
          "tokens_per_sec": tps,
          "tflops_per_device": tflops,
          "mfu": tflops * 1e12 / peak if peak else 0.0,
          "step_time_s": elapsed / window_steps,
          "skipped_steps": skipped.total,
        }
        record.update({f"memory/{k}": v for k, v in memory.items()})
        record.update({f"memory/{k}": v for k, v in metrics_lib.live_memory().items()})
        writer.write(step, record)
        logging.info(
          "step %d/%d | loss %.4f per supervised token (%d) | grad_norm %.3f | lr %.2e | "
          "%.0f tok/s | %.3f TFLOP/s/device | MFU %.1f%%",
          step,
          cfg.steps,
          record["loss"],
          record["supervised_tokens"],
          record["grad_norm"],
          record["learning_rate"],
          tps,
          tflops,
          100 * record["mfu"],
        )
        window_tokens, window_steps, t_window = 0.0, 0, time.perf_counter()
      if preempted:
        checkpointer.save(
          step, state, train_iter.get_state(), ckpt_lib.experiment_meta(exp), wait=True
        )
        logging.warning(
          "Preempted: stopped at step %d of %d with a checkpoint in %s; run again to resume.",
          step,
          cfg.steps,
          checkpointer.directory,
        )
        preemption.stopped_at = step
        return state, False
      # Held-out loss every eval_every steps and at the end; retrieval evals
      # every retrieval_eval_every steps and at the end, when configured.
      if cfg.eval_every and (step % cfg.eval_every == 0 or last):
        ev = evaluate_loss(exp, trainer, state)
        writer.write(step, ev)
        logging.info("step %d | eval loss %.4f", step, ev["eval/loss"])
      if exp.evals is not None and (
        last or (cfg.retrieval_eval_every and step % cfg.retrieval_eval_every == 0)
      ):
        results = evaluate_retrieval(exp, trainer, state, workdir, step, generate=last)
        writer.write(step, results)
        logging.info("step %d | retrieval %s", step, _summary(results))
      if checkpointer.should_save(step, final=last):
        checkpointer.save(step, state, train_iter.get_state(), ckpt_lib.experiment_meta(exp))
        t_window = time.perf_counter()  # do not bill the save to throughput
  except errors.InputError as err:
    checkpoint_before_input_error(err, exp, checkpointer, step, state, train_iter)
    raise
  # The last step ran the held-out loss (if eval_every) and the retrieval
  # evals (if configured); train_and_eval need not repeat them.
  return state, bool(cfg.eval_every) or exp.evals is not None


def start_state(exp: Experiment, trainer: Trainer, checkpointer, train_iter, mode: str):
  """The state a run starts from, and the log line that says which:
  the workdir's latest checkpoint (resume), else TrainConfig.init_params_from
  (step 0, fresh optimizer state), else random initialisation (not for eval)."""
  source = exp.train.init_params_from
  restored = checkpointer.restore_latest(trainer.abstract_state, ckpt_lib.experiment_meta(exp))
  if restored is not None:
    latest, state, data_state = restored
    if data_state:
      train_iter.set_state(data_state)
    logging.info("Resumed from step %d in %s.", latest, checkpointer.directory)
    if source:
      logging.info(
        "TrainConfig.init_params_from=%s is not used: it applies to a fresh workdir only.",
        source,
      )
    return state
  if source:
    found = init_from.find_source(source)
    params = init_from.load_params(found, exp.model, trainer.abstract_state["params"])
    logging.info(
      "Started at step 0 from the parameters of %s (TrainConfig.init_params_from), "
      "with fresh optimizer state.",
      found,
    )
    return trainer.state_from_params(params, exp.train.seed)
  if mode == "eval":
    raise FileNotFoundError(
      f"--mode=eval needs a checkpoint, and {checkpointer.directory} has "
      "none. Train first (--mode=train) with this --workdir, or set "
      "TrainConfig.init_params_from to evaluate other parameters."
    )
  logging.info("Started at step 0 from random parameters (seed %d).", exp.train.seed)
  return trainer.init_state(exp.train.seed)


def _summary(results: dict[str, float], limit: int = 8) -> str:
  keys = sorted(k for k in results if "acc" in k)
  return ", ".join(f"{k}={results[k]:.2f}" for k in keys[:limit])


def run(mode: str, workdir: str, exp: Experiment):
  """Runs one experiment in `workdir` (created if missing): train, evaluate or
  both (MODES), or print the training stream's packing statistics."""
  if mode not in MODES:
    raise ValueError(f"--mode={mode!r} is not one of {MODES}.")
  os.makedirs(workdir, exist_ok=True)
  mesh = mesh_lib.make_mesh(exp.mesh)
  logging.info(
    "Mesh %s on %d devices (%s).",
    mesh_lib.mesh_shape(mesh),
    jax.device_count(),
    jax.devices()[0].device_kind,
  )
  if mode == "inspect_data":
    # The global batch, as the train step sees it; process 0 writes the record.
    path = os.path.join(workdir, "inspect_data.json") if jax.process_index() == 0 else None
    print(
      data_lib.inspect_data(
        exp.data,
        batch_size=exp.train.batch_size,
        seq_len=exp.train.seq_len,
        seed=exp.train.seed,
        json_path=path,
      )
    )
    return

  trainer = Trainer(exp.model, exp.train, mesh)
  checkpointer = ckpt_lib.Checkpointer(
    workdir,
    save_every=exp.train.checkpoint_every,
    keep=exp.train.keep_checkpoints,
    async_save=exp.train.async_checkpoint,
  )
  train_iter = make_data_iterator(exp, trainer, "train", seed=exp.train.seed)
  state = start_state(exp, trainer, checkpointer, train_iter, mode)

  writer = metrics_lib.MetricWriter(workdir)
  skipped_rows = data_lib.skipped_rows(exp.data)
  if skipped_rows:
    logging.warning(
      "The data skipped %d bad rows (DataConfig.skip_bad_rows); the first: %s",
      skipped_rows["data/skipped_rows"],
      skipped_rows["data/first_skipped_row"],
    )
    writer.write(int(jax.device_get(state["step"])), skipped_rows)
  preemption = ckpt_lib.PreemptionWatch() if mode in ("train", "train_and_eval") else None
  profiler = metrics_lib.Profiler(exp.train.profile_steps, os.path.join(workdir, "profile"))
  try:
    evaluated = False
    if preemption is not None:
      state, evaluated = train_loop(
        exp, trainer, state, train_iter, checkpointer, writer, workdir, preemption, profiler
      )
      preemption.close()  # what follows (evals) ends on SIGTERM as usual
      if preemption.stopped_at is not None or preemption.notified:
        return
    if mode == "eval" or (mode == "train_and_eval" and not evaluated):
      step = int(jax.device_get(state["step"]))
      results = evaluate_loss(exp, trainer, state)
      logging.info("step %d | eval loss %.4f", step, results["eval/loss"])
      results.update(evaluate_retrieval(exp, trainer, state, workdir, step))
      writer.write(step, results)
  finally:
    profiler.stop()
    if preemption is not None:
      preemption.close()
    checkpointer.close()
    writer.close()
