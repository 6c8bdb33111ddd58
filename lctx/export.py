"""`--mode=export_hf`: a checkpoint of a workdir written as a Hugging Face directory.

python main.py --mode=export_hf --gin_file=G --workdir=W --export_dir=D \
  [--export_step=N] [--export_dtype=bfloat16|float32]

The train state is restored with the trainer's own shardings (so no host ever
holds the whole model), then lctx.models.hf.save_pretrained gathers one tensor
(one layer's slice of a stacked param) at a time and process 0 writes it.
"""

from __future__ import annotations

import os

import jax
from absl import logging

from lctx import checkpoint as ckpt_lib
from lctx.models import hf
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import Trainer


def run_export_hf(
  exp, workdir: str, *, export_dir: str | None, step: int | None = None, dtype: str = "bfloat16"
) -> dict:
  """Writes checkpoint `step` (default: the latest) of `workdir` to `export_dir`.
  Returns {'step', 'export_dir', 'files'}."""
  if not export_dir:
    raise ValueError("--mode=export_hf needs --export_dir (the Hugging Face directory to write)")
  if dtype not in ("bfloat16", "float32"):
    raise ValueError(f"--export_dtype={dtype!r}: use 'bfloat16' or 'float32'")
  hf.architecture_for(exp.model)  # refuse an inexpressible model before restoring anything
  checkpointer = ckpt_lib.Checkpointer(workdir, save_every=0, keep=1 << 30, async_save=False)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise FileNotFoundError(
        f"--mode=export_hf needs a checkpoint, and {checkpointer.directory} has none."
      )
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ValueError(f"--export_step={step}: {checkpointer.directory} has steps {steps}")
    trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
    state, _ = checkpointer.restore(step, trainer.abstract_state, ckpt_lib.experiment_meta(exp))
  finally:
    checkpointer.close()
  files = hf.save_pretrained(export_dir, exp.model, state["params"], dtype=dtype)
  if jax.process_index() == 0:
    logging.info(
      "Exported step %d of %s to %s (%s, %d files).", step, workdir, export_dir, dtype, len(files)
    )
  return {"step": step, "export_dir": os.path.abspath(export_dir), "files": files}
