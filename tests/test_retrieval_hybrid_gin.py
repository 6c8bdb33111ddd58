"""gin/local_cpu_retrieval_hybrid.gin is gin/local_cpu_retrieval.gin with a 3:1
Gated DeltaNet model: the same data, schedule (but a lower peak learning
rate), mesh, strategy and evals, the
same width and heads, and a model whose parameter tree has linear-attention
mixers in three layers of four (built abstractly: no compile, seconds)."""

import dataclasses
import os

import gin
import jax
import numpy as np

from lctx import configs, gin_utils
from lctx.models import Transformer
from lctx.models.config import has_linear_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HYBRID = "gin/local_cpu_retrieval_hybrid.gin"
BASE = "gin/local_cpu_retrieval.gin"
# The only model fields the hybrid file sets beyond its base.
HYBRID_FIELDS = {
  "num_layers",
  "layer_types",
  "attention_pattern",  # derived from layer_types: (None,) * 4
  "linear_attention",
  "linear_num_key_heads",
  "linear_num_value_heads",
  "linear_key_head_dim",
  "linear_value_head_dim",
  "linear_conv_kernel_dim",
}


def _experiment(path):
  gin.clear_config()
  gin_utils.parse([path], [], [ROOT])
  try:
    return configs.experiment()
  finally:
    gin.clear_config()


def test_hybrid_file_is_the_retrieval_recipe_with_three_linear_layers_in_four():
  hybrid, base = _experiment(HYBRID), _experiment(BASE)
  c = hybrid.model
  assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
  assert has_linear_layers(c) and c.linear_attention == "gated_deltanet"
  # Same data, schedule, mesh, strategy and evals; same width and heads. The
  # peak learning rate alone is lower (1e-3 against 1.5e-3: docs/benchmarks.md,
  # "Hybrid CPU proof").
  assert hybrid.data == base.data
  assert (hybrid.train.learning_rate, base.train.learning_rate) == (1e-3, 1.5e-3)
  assert hybrid.train == dataclasses.replace(base.train, learning_rate=1e-3)
  assert hybrid.mesh == base.mesh and hybrid.evals == base.evals
  changed = {
    f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(base.model, f.name)
  }
  assert changed <= HYBRID_FIELDS, changed - HYBRID_FIELDS
  assert (c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
    base.model.d_model,
    base.model.num_heads,
    base.model.num_kv_heads,
    base.model.head_dim,
    base.model.vocab_size,
  )


def test_hybrid_model_builds_linear_mixers():
  c = _experiment(HYBRID).model
  ids = jax.ShapeDtypeStruct((1, 8), np.int32)
  shapes = jax.eval_shape(lambda i: Transformer(c).init(jax.random.key(0), i, i, i), ids)
  leaves = jax.tree_util.tree_leaves_with_path(shapes)
  names = [jax.tree_util.keystr(p) for p, _ in leaves]
  total = sum(int(np.prod(x.shape)) for _, x in leaves)
  assert total == c.num_params()
  assert any("conv" in n for n in names), names  # the linear layers' short conv
  assert any("wq" in n or "q_proj" in n or "query" in n for n in names), names


def test_hybrid_extension_is_the_extension_stage_with_the_hybrid_model():
  """gin/local_cpu_extension_hybrid.gin: gin/local_cpu_extension.gin's stage (YaRN,
  2048-token rows, schedule, data, evals, mesh) on the hybrid's model."""
  stage = _experiment("gin/local_cpu_extension_hybrid.gin")
  full_stage = _experiment("gin/local_cpu_extension.gin")
  hybrid = _experiment(HYBRID)
  assert stage.model == dataclasses.replace(
    hybrid.model, rope_scaling=full_stage.model.rope_scaling
  )
  assert dict(stage.model.rope_scaling)["rope_type"] == "yarn"
  assert stage.train == dataclasses.replace(
    full_stage.train, init_params_from=stage.train.init_params_from
  )
  assert stage.train.init_params_from == "/tmp/lctx/retrieval_hybrid"
  assert stage.data == full_stage.data and stage.evals == full_stage.evals
  assert stage.mesh == full_stage.mesh
