"""Gin at the edge: the only module that registers lctx types with gin.

Library code takes plain typed arguments; this file makes the config
dataclasses and the experiment bindable from gin files, e.g.

    experiment.model = @ModelConfig()
    ModelConfig.d_model = 256
    TrainConfig.context_parallel_strategy = 'ring'
"""

from __future__ import annotations

import gin

from lctx import data as data_lib
from lctx import evals as evals_lib
from lctx import models
from lctx import train as train_lib
from lctx.evals import mixture
from lctx.parallel import mesh as mesh_lib
from lctx.trainer import TrainConfig

ModelConfig = gin.external_configurable(models.ModelConfig, "ModelConfig")
MeshConfig = gin.external_configurable(mesh_lib.MeshConfig, "MeshConfig")
DataConfig = gin.external_configurable(data_lib.DataConfig, "DataConfig")
TrainConfigG = gin.external_configurable(TrainConfig, "TrainConfig")


EvalConfig = gin.external_configurable(evals_lib.EvalConfig, "EvalConfig")
# The retrieval tasks join the data mixture as `retrieval_<task>` sources, so gin
# files can name them in DataConfig.sources.
mixture.register_retrieval_sources()


@gin.configurable("experiment")
def experiment(
  model=gin.REQUIRED, data=gin.REQUIRED, train=None, mesh=None, evals=None
) -> train_lib.Experiment:
  """The gin-bound Experiment: `experiment.model = @ModelConfig()`, ..."""
  return train_lib.Experiment(
    model=model,
    data=data,
    train=train or TrainConfig(),
    mesh=mesh or mesh_lib.MeshConfig(),
    evals=evals,
  )
