"""Gin at the edge: the only module that registers lctx types with gin.

Library code takes plain typed arguments; this file makes the config
dataclasses and the experiment bindable from gin files, e.g.

    experiment.model = @ModelConfig()
    ModelConfig.d_model = 256
    TrainConfig.context_parallel_strategy = 'ring'
"""

from __future__ import annotations

import os

import gin
from gin import config_parser

from lctx import data as data_lib
from lctx import evals as evals_lib
from lctx import init_from, models
from lctx import train as train_lib
from lctx.errors import ConfigError
from lctx.evals import mixture
from lctx.kernels import options as kernel_options
from lctx.parallel import mesh as mesh_lib
from lctx.parallel import options as context_options
from lctx.train_config import TrainConfig

ModelConfig = gin.external_configurable(models.ModelConfig, "ModelConfig")
MeshConfig = gin.external_configurable(mesh_lib.MeshConfig, "MeshConfig")
DataConfig = gin.external_configurable(data_lib.DataConfig, "DataConfig")
TrainConfigG = gin.external_configurable(TrainConfig, "TrainConfig")
# The options objects TrainConfig holds: `TrainConfig.attention_options =
# @AttentionOptions()`, `TrainConfig.context_options = @ContextOptions()`.
AttentionOptionsG = gin.external_configurable(kernel_options.AttentionOptions, "AttentionOptions")
ContextOptionsG = gin.external_configurable(context_options.ContextOptions, "ContextOptions")
# Each options class, the TrainConfig field that must reference it for its
# bindings to apply.
_OPTIONS_FIELDS = {"AttentionOptions": "attention_options", "ContextOptions": "context_options"}


EvalConfig = gin.external_configurable(evals_lib.EvalConfig, "EvalConfig")
# The retrieval tasks join the data mixture as `retrieval_<task>` sources, so gin
# files can name them in DataConfig.sources.
mixture.register_retrieval_sources()


MODEL_GIN_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin", "models"
)


def model_config(name: str, **overrides) -> models.ModelConfig:
  """The ModelConfig that gin/models/<name>.gin binds, with keyword overrides.

  The model-size gin files are the one place sizes are written; this reads their
  `ModelConfig.<field> = <value>` bindings without touching the global gin config.
  """
  path = os.path.join(MODEL_GIN_DIR, f"{name}.gin")
  if not os.path.exists(path):
    known = sorted(os.path.splitext(f)[0] for f in os.listdir(MODEL_GIN_DIR))
    raise ValueError(f"no model size {name!r}: {path} does not exist; known: {known}")
  with open(path) as f:
    parser = config_parser.ConfigParser(f.read(), gin.config.ParserDelegate(skip_unknown=True))
    fields = {}
    for statement in parser:
      if (
        not isinstance(statement, config_parser.BindingStatement)
        or statement.selector != "ModelConfig"
      ):
        raise ValueError(
          f"{path}: model-size files hold only ModelConfig bindings; got {statement}"
        )
      fields[statement.arg_name] = statement.value
  return models.ModelConfig(**{**fields, **overrides})


def _check_options_referenced() -> None:
  """Bindings of an options class apply only through the TrainConfig field that
  references it; binding them without the reference is an error, not a no-op."""
  train = gin.get_bindings("TrainConfig")
  for kind, field in _OPTIONS_FIELDS.items():
    bound = gin.get_bindings(kind)
    if bound and field not in train:
      raise ConfigError(
        f"{kind}.{sorted(bound)[0]} is bound, but TrainConfig.{field} does not "
        f"reference {kind}, so it would not apply.",
        fix=f"Add TrainConfig.{field} = @{kind}().",
      )


@gin.configurable("target")
def target(compile_topology: str | None = None) -> str | None:
  """The hardware an experiment file is written for, named as --compile_topology
  names it: a TPU slice ('v5p:4x4x4') or a GPU node ('h100x8'); None for CPU runs.
  gin/runs/base.gin binds it to the COMPILE_TOPOLOGY macro, which such files set."""
  return compile_topology


@gin.configurable("experiment")
def experiment(
  model=gin.REQUIRED, data=gin.REQUIRED, train=None, mesh=None, evals=None
) -> train_lib.Experiment:
  """The gin-bound Experiment: `experiment.model = @ModelConfig()`, ...

  With `TrainConfig.init_params_from` set to a Hugging Face directory, the model
  is that directory's config.json with the ModelConfig fields gin binds set on
  top: the shape fields must agree with it (an error names the one that does
  not), the others (dtypes, remat, chunking, RoPE for an extension) are gin's.
  """
  _check_options_referenced()
  train = train or TrainConfig()
  if train.init_params_from and init_from.is_hf_dir(train.init_params_from):
    model = init_from.hf_model_config(train.init_params_from, gin.get_bindings("ModelConfig"))
  return train_lib.Experiment(
    model=model,
    data=data,
    train=train,
    mesh=mesh or mesh_lib.MeshConfig(),
    evals=evals,
  )
