"""Orbax checkpoints: asynchronous saves, keep the last K, resume from latest.

A checkpoint holds three items:
  state: the train state pytree (params, optimizer state, step, rng), each
         process writing its own shards;
  data:  every process's data-iterator JSON state (`{"processes": [...]}`,
         gathered to process 0, which writes JSON items), so a resumed run sees
         exactly the batches an uninterrupted run would;
  meta:  the model and run configs; a resume whose parameter tree differs
         (shapes, dtype: models.config.param_layout) is refused with a message
         naming the fields, any other change is logged as a warning.

`restore_latest` resumes from the newest checkpoint that restores: one that
is partial or corrupt (missing or damaged files) is moved aside to
`<workdir>/checkpoints.corrupt/` with a warning, and the next older one is
tried. All processes agree on the outcome of every attempt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from lctx.models.config import param_layout


def experiment_meta(exp) -> dict[str, Any]:
  """The meta item a checkpoint of `exp` (an lctx.configs.Experiment) is
  written with and compared against: {'model': ModelConfig fields (must agree
  where they fix the parameter tree), 'run': {'train': ..., 'data': ...} (a
  change is logged)}."""
  return {
    "model": dataclasses.asdict(exp.model),
    "run": {"train": dataclasses.asdict(exp.train), "data": dataclasses.asdict(exp.data)},
  }


class CheckpointMismatchError(ValueError):
  """The checkpoint in the workdir was written with an incompatible config."""


def _diff(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
  lines = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
      lines += _diff(a, b, f"{prefix}{key}.")
    elif _normalise(a) != _normalise(b):
      lines.append(f"{prefix}{key}: checkpoint has {a!r}, config has {b!r}")
  return lines


def param_layout_mismatches(saved_model: Mapping[str, Any], model: Mapping[str, Any]) -> list[str]:
  """'model.<field>: checkpoint has A, config has B' for each setting of the
  parameter tree (models.config.param_layout) that differs; [] if none."""
  saved, current = param_layout(saved_model), param_layout(model)
  return [
    f"model.{name}: checkpoint has {saved[name]!r}, config has {current[name]!r}"
    for name in saved
    if _normalise(saved[name]) != _normalise(current[name])
  ]


def _normalise(v):
  # JSON turns tuples into lists.
  if isinstance(v, (list, tuple)):
    return [_normalise(x) for x in v]
  return v


def _gather_json(obj: Any) -> list[Any]:
  """Every process's JSON-serialisable `obj`, in process order (a collective)."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.array([data.size], np.int32)).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(rows[i, : sizes[i]])) for i in range(len(sizes))]


def _all_processes(ok: bool) -> bool:
  """True when `ok` holds on every process (a collective)."""
  if jax.process_count() == 1:
    return ok
  return bool(multihost_utils.process_allgather(np.array([ok], np.int32)).min())


class Checkpointer:
  """Thin wrapper around `ocp.CheckpointManager` for the train loop."""

  def __init__(self, workdir: str, *, save_every: int, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      enable_async_checkpointing=async_save,
      create=True,
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def should_save(self, step: int, final: bool = False) -> bool:
    return final or (self.save_every > 0 and step % self.save_every == 0)

  def save(
    self,
    step: int,
    state: Any,
    data_state: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
    wait: bool = False,
  ) -> None:
    """Saves `step` (all processes call this); `wait` blocks until it is on disk."""
    processes = _gather_json(dict(data_state or {}))
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave({"processes": processes}),
      meta=ocp.args.JsonSave(dict(meta)),
    )
    self._manager.save(step, args=args, force=True)
    if wait:
      self._manager.wait_until_finished()
      logging.info("Checkpoint for step %d written to %s", step, self.directory)
    else:
      logging.info("Checkpoint for step %d is being written to %s", step, self.directory)

  def check_compatible(self, step: int, meta: Mapping[str, Any]) -> None:
    """Raises CheckpointMismatchError naming every change to the parameter tree.

    Only what fixes the stored parameters' names, shapes and dtypes must match
    (lctx.models.config.param_layout); any other model change (RoPE, remat,
    chunking, windows) and any run change is resumed with a warning per field.
    """
    saved = self.read_meta(step)
    mismatches = param_layout_mismatches(saved.get("model", {}), meta.get("model", {}))
    if mismatches:
      raise CheckpointMismatchError(
        f"Cannot resume from {self.directory} step {step}: the parameters' shapes "
        "or dtype differ from those the checkpoint was written with:\n  "
        + "\n  ".join(mismatches)
        + "\nUse a new --workdir (TrainConfig.init_params_from can start it from "
        "this checkpoint's parameters where the shapes allow), or restore the "
        "original settings."
      )
    for line in _diff(saved.get("model", {}), meta.get("model", {}), "model."):
      logging.warning("Resuming with a changed model setting (same parameters): %s", line)
    for line in _diff(saved.get("run", {}), meta.get("run", {}), "run."):
      logging.warning("Resuming with a changed setting: %s", line)

  def read_meta(self, step: int) -> dict[str, Any]:
    """The meta item of checkpoint `step` (the configs it was written with)."""
    return dict(
      self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      or {}
    )

  def restore(
    self, step: int, abstract_state: Any, meta: Mapping[str, Any]
  ) -> tuple[Any, dict[str, Any]]:
    """Restores (state, this process's data_state) at `step` after checking compatibility."""
    self.check_compatible(step, meta)
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
      ),
    )
    return restored["state"], self._own_data_state(step, dict(restored["data"] or {}))

  def _own_data_state(self, step: int, saved: dict[str, Any]) -> dict[str, Any]:
    if "processes" not in saved:  # written before per-process data states
      return saved if jax.process_count() == 1 else {}
    processes = saved["processes"]
    if len(processes) != jax.process_count() and all(p == processes[0] for p in processes):
      # Every process saved the same state (lctx.data reads one global order):
      # it continues the same stream on any number of processes.
      return dict(processes[0] or {})
    if len(processes) != jax.process_count():
      logging.warning(
        "Checkpoint step %d holds the data state of %d processes, this run has %d: "
        "the data stream restarts from its beginning.",
        step,
        len(processes),
        jax.process_count(),
      )
      return {}
    return dict(processes[jax.process_index()] or {})

  def restore_latest(
    self, abstract_state: Any, meta: Mapping[str, Any]
  ) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, data_state) of the newest checkpoint that restores; None if none exist.

    A checkpoint that fails to restore (missing or damaged files) is moved to
    `<workdir>/checkpoints.corrupt/` with a warning, and the next older one is
    tried; if none restores, the last error is raised. A config mismatch
    (CheckpointMismatchError) is raised at once.
    """
    steps = self.all_steps()
    error = None
    for step in reversed(steps):
      try:
        state, data_state = self.restore(step, abstract_state, meta)
        ok = True
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
        state, data_state, ok, error = None, None, False, e
      if _all_processes(ok):
        return step, state, data_state
      logging.warning(
        "Checkpoint step %d in %s is corrupt (%s); skipping it and trying an older one.",
        step,
        self.directory,
        f"{type(error).__name__}: {str(error)[:300]}" if error else "unreadable on another process",
      )
      self._set_aside(step)
    if steps:
      raise RuntimeError(
        f"No checkpoint in {self.directory} restores (tried steps {steps}); "
        "the last error is above. Move the directory away to start afresh."
      ) from error
    return None

  def _set_aside(self, step: int) -> None:
    """Moves a corrupt step out of the manager's directory (kept for inspection)."""
    if jax.process_index() == 0:
      aside = self.directory + ".corrupt"
      os.makedirs(aside, exist_ok=True)
      target = os.path.join(aside, f"{step}.{int(time.time())}")
      os.rename(os.path.join(self.directory, str(step)), target)
      logging.warning("Moved the corrupt checkpoint step %d to %s", step, target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"lctx_checkpoint_set_aside_{step}")
    self._manager.reload()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


class PreemptionWatch:
  """Has a preemption notice (SIGTERM) reached the run? The same answer on every process.

  Multi-process runs use jax's preemption sync service (started by
  jax.distributed.initialize; it catches SIGTERM on any process and makes every
  process stop at the same step). Otherwise a Python SIGTERM handler raises a
  flag, and with several processes a per-step cross-process max makes them
  agree. Call `reached(step)` once per step on every process.
  """

  def __init__(self):
    self._flag = False
    self._previous = None
    self.stopped_at: int | None = None  # set by the loop when it stops for a notice
    self._service = jax.process_count() > 1 and _preemption_service_running()
    if not self._service and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):  # pylint: disable=unused-argument
    self._flag = True
    logging.warning("SIGTERM: finishing this step, then checkpointing and exiting.")

  def reached(self, step: int) -> bool:
    if self._service:
      return multihost_utils.reached_preemption_sync_point(step)
    return not _all_processes(not self._flag)

  @property
  def notified(self) -> bool:
    """This process caught SIGTERM (single-process runs; the loop may have ended since)."""
    return self._flag

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


def _preemption_service_running() -> bool:
  """Whether jax.distributed started its preemption sync service (jax's own state)."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top

    return distributed.global_state.preemption_sync_manager is not None
  except (ImportError, AttributeError):  # moved in a later jax: the signal-flag fallback
    return False
