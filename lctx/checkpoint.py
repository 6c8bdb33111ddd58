"""Orbax checkpoints: asynchronous saves, keep the last K, resume from latest.

A checkpoint holds three items:
  state: the train state pytree (params, optimizer state, step, rng);
  data:  the data iterator's JSON state, so a resumed run sees exactly the
         batches an uninterrupted run would;
  meta:  the model config (and other fingerprints) used to refuse a resume
         whose config does not match, with a message naming the fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import orbax.checkpoint as ocp
from absl import logging


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


def _normalise(v):
  # JSON turns tuples into lists.
  if isinstance(v, (list, tuple)):
    return [_normalise(x) for x in v]
  return v


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

  def should_save(self, step: int, final: bool = False) -> bool:
    return final or (self.save_every > 0 and step % self.save_every == 0)

  def save(
    self, step: int, state: Any, data_state: Mapping[str, Any] | None, meta: Mapping[str, Any]
  ) -> None:
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(dict(data_state or {})),
      meta=ocp.args.JsonSave(dict(meta)),
    )
    self._manager.save(step, args=args, force=True)
    logging.info("Checkpoint for step %d is being written to %s", step, self.directory)

  def check_compatible(self, step: int, meta: Mapping[str, Any]) -> None:
    """Raises CheckpointMismatchError naming every mismatched model field."""
    saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
      "meta"
    ]
    mismatches = _diff(saved.get("model", {}), meta.get("model", {}), "model.")
    if mismatches:
      raise CheckpointMismatchError(
        f"Cannot resume from {self.directory} step {step}: the model config "
        "differs from the one the checkpoint was written with:\n  "
        + "\n  ".join(mismatches)
        + "\nUse a new --workdir, or restore the original settings."
      )
    for line in _diff(saved.get("run", {}), meta.get("run", {}), "run."):
      logging.warning("Resuming with a changed setting: %s", line)

  def restore(
    self, step: int, abstract_state: Any, meta: Mapping[str, Any]
  ) -> tuple[Any, dict[str, Any]]:
    """Restores (state, data_state) at `step` after checking compatibility."""
    self.check_compatible(step, meta)
    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
      ),
    )
    return restored["state"], dict(restored["data"] or {})

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
