"""Parameters from elsewhere: `TrainConfig.init_params_from`.

A fresh run can start at step 0, with fresh optimizer state, from the parameters
of either
  - a Hugging Face directory (`config.json` plus `model.safetensors` or
    `model.safetensors.index.json`), read by lctx.models.hf, each process reading
    only the slices its devices hold; or
  - an lctx checkpoint: a checkpoint step directory (`<workdir>/checkpoints/<N>`),
    the `checkpoints` directory or a workdir (their latest step). Only the params
    are restored (orbax partial restore); the optimizer state, step, rng and data
    state of that run are not read. This is how one training stage starts from
    the last (e.g. a longer sequence, another RoPE schedule, its own warm-up).

Both end in the same place: a params tree with the trainer's own shardings
(`Trainer.state_sharding['params']`), which `Trainer.state_from_params` turns into
the step-0 state. A workdir that already has checkpoints resumes from them
instead (lctx/train.py); init_params_from applies to a fresh workdir only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from lctx import checkpoint as ckpt_lib
from lctx import models
from lctx.errors import ConfigError
from lctx.models import config as config_lib

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclasses.dataclass(frozen=True)
class Source:
  """Where the parameters come from.

  kind: 'hf' (a Hugging Face directory) or 'lctx' (an lctx checkpoint);
  path: the HF directory, or the lctx run's `checkpoints` directory;
  step: the lctx checkpoint step (None for 'hf').
  """

  kind: str
  path: str
  step: int | None = None

  def __str__(self) -> str:
    if self.kind == "hf":
      return f"the Hugging Face checkpoint {self.path}"
    return f"the lctx checkpoint {self.path} step {self.step}"


def is_hf_dir(path: str) -> bool:
  """A directory as transformers writes it: config.json plus safetensors weights."""
  where = epath.Path(os.path.expanduser(path))
  try:
    return (where / "config.json").is_file() and any((where / f).is_file() for f in HF_WEIGHT_FILES)
  except ImportError as e:  # fsspec has no backend for the scheme (gs:// without gcsfs)
    raise ConfigError(f"TrainConfig.init_params_from={path!r} cannot be read here: {e}") from None


def _steps_in(directory: epath.Path) -> list[int]:
  if not directory.is_dir():
    return []
  return sorted(int(d.name) for d in directory.iterdir() if d.name.isdigit())


def find_source(path: str) -> Source:
  """Resolves `init_params_from` to a Source; a ValueError says what was expected.

  Local paths and any path orbax can read (etils.epath: gs:// too)."""
  path = os.path.expanduser(path)
  if "://" not in path:
    path = os.path.abspath(path)
  if is_hf_dir(path):
    return Source("hf", path)
  where = epath.Path(path)
  if where.name.isdigit() and (where / "state").is_dir():
    return Source("lctx", str(where.parent), int(where.name))
  for directory in (where / "checkpoints", where):
    steps = _steps_in(directory)
    if steps:
      return Source("lctx", str(directory), steps[-1])
  raise ValueError(
    f"TrainConfig.init_params_from={path!r} is neither a Hugging Face directory "
    f"(config.json plus one of {HF_WEIGHT_FILES}) nor an lctx checkpoint (a "
    "workdir with checkpoints/<step>, a checkpoints directory, or a step directory)."
  )


# ----------------------------------------------------------------------------
# The model config
# ----------------------------------------------------------------------------
def hf_model_config(path: str, overrides: Mapping[str, Any]) -> models.ModelConfig:
  """The ModelConfig of an HF directory (its config.json), with `overrides` set.

  overrides: ModelConfig fields a gin file binds. The shape fields
  (models.config.SHAPE_FIELDS) come from config.json: an override that disagrees
  is a ValueError naming the field; one that agrees is accepted. Every other
  field (dtypes, remat, chunking, RoPE theta and scaling for an extension, ...)
  takes the override. Reads config.json only, never a tensor.
  """
  from lctx.models import hf  # pylint: disable=g-import-not-at-top

  base = hf.load_config(path)
  for name, value in overrides.items():
    if name not in config_lib.SHAPE_FIELDS:
      continue
    given = getattr(dataclasses.replace(base, **{name: value}), name)
    if given != getattr(base, name):
      raise ValueError(
        f"ModelConfig.{name} = {value!r} disagrees with {path}/config.json, which gives "
        f"{getattr(base, name)!r}: with TrainConfig.init_params_from set to a Hugging "
        "Face directory the parameter shapes come from its config.json; remove the "
        "binding or make it match."
      )
  return dataclasses.replace(base, **dict(overrides))


def check_model(source: Source, model_cfg: models.ModelConfig) -> None:
  """Raises a ValueError naming each field where `model_cfg`'s parameters cannot
  take the source's: a shape field (HF), or the parameter tree's layout except
  param_dtype (lctx; restoring casts the dtype)."""
  if source.kind == "hf":
    from lctx.models import hf  # pylint: disable=g-import-not-at-top

    theirs = hf.load_config(source.path)
    lines = [
      f"model.{f}: {source.path}/config.json gives {getattr(theirs, f)!r}, config has "
      f"{getattr(model_cfg, f)!r}"
      for f in config_lib.SHAPE_FIELDS
      if getattr(theirs, f) != getattr(model_cfg, f)
    ]
  else:
    saved = _meta(source).get("model", {})
    lines = [
      line
      for line in ckpt_lib.param_layout_mismatches(saved, dataclasses.asdict(model_cfg))
      if not line.startswith("model.param_dtype:")
    ]
  if lines:
    raise ValueError(
      f"TrainConfig.init_params_from: the parameters of {source} do not fit this "
      "model:\n  " + "\n  ".join(lines)
    )


# ----------------------------------------------------------------------------
# The parameters
# ----------------------------------------------------------------------------
def load_params(source: Source, model_cfg: models.ModelConfig, abstract_params: Any) -> Any:
  """The source's params as global arrays laid out like `abstract_params`.

  abstract_params: jax.ShapeDtypeStruct leaves carrying the shardings the run
  uses (Trainer.abstract_state['params']). Every process calls this; each reads
  only the slices its own devices hold.
  """
  check_model(source, model_cfg)
  if source.kind == "hf":
    from lctx.models import hf  # pylint: disable=g-import-not-at-top

    shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
    return hf.load_pretrained_sharded(source.path, model_cfg, shardings)
  item = {"params": abstract_params}
  restored = _manager(source).restore(
    source.step,
    args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
      )
    ),
  )
  return restored["state"]["params"]


def _manager(source: Source) -> ocp.CheckpointManager:
  # Read-only: the source may be another run's live workdir.
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
  return ocp.CheckpointManager(source.path, options=options)


def _meta(source: Source) -> dict[str, Any]:
  meta = _manager(source).restore(
    source.step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
  )["meta"]
  return dict(meta or {})
