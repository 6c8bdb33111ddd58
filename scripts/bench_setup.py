"""Set-up shared by the CPU step benchmarks (bench_train, bench_evals, bench_step_estimate).

Call `fake_devices` before jax is imported: it gives XLA the gin files'
`LOCAL_DEVICES` CPU devices. `trainer_for` binds the gin files and builds the
experiment's Trainer on its mesh; `random_batch` is one batch of the experiment's
shape with every token real (no padding, one document per row).
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_devices(gin_files, gin_params) -> None:
  """The gin files' LOCAL_DEVICES macro as fake CPU devices, as main.py sets them
  (lctx.platforms.set_fake_devices); no-op without the macro."""
  from lctx import gin_utils, platforms  # pylint: disable=g-import-not-at-top  (no jax import)

  platforms.set_fake_devices(gin_utils.local_devices_macro(gin_files, [ROOT], gin_params))


def trainer_for(gin_files, gin_params):
  """(experiment, Trainer, initial state from seed 0) of the bound gin files."""
  from lctx import configs, gin_utils  # pylint: disable=g-import-not-at-top
  from lctx.parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from lctx.trainer import Trainer  # pylint: disable=g-import-not-at-top

  gin_utils.parse(gin_files, gin_params, [ROOT])
  exp = configs.experiment()
  trainer = Trainer(exp.model, exp.train, mesh_lib.make_mesh(exp.mesh))
  return exp, trainer, trainer.init_state(0)


def random_batch(exp, seed: int = 0) -> dict:
  """A natural-order train batch: batch_size x seq_len random byte-range tokens
  (ids 3..258, within the vocabulary), one document per row, loss on every token."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  b, t = exp.train.batch_size, exp.train.seq_len
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, min(exp.model.vocab_size, 259), (b, t + 1), dtype=np.int32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": np.ones((b, t), np.int32),
    "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
    "loss_mask": np.ones((b, t), np.float32),
  }
