"""Mesh, logical-axis rules and the context-parallel attention strategies.

Where things are: the strategy decision for a run (strategy, load balance, ring
size, device order, kernel platform) is `plan.py`'s `ContextPlan`; the zigzag
reorder is `zigzag.py`; the rules each strategy enforces are `validation.py`;
the strategy is decided in `auto.py` (`decide_strategy`, `auto`'s choice
included; the attention buffers it sizes with are `attention_memory.py`, home of
`AttentionDims`, the one head-dimensions type); the run's settings are
`ContextOptions` (`options.py`, beside the kernels' `AttentionOptions`); the
strategies themselves are `all_gather.py`, `ulysses.py` (ulysses and usp) and
`ring.py`, dispatched over the mesh by `context.py` (`make_attention_fn`).
What the model calls in each layer is the `SequenceMixer` of `mixer.py`, which
the plan builds (`ContextPlan.mixer`); `context_attention` (plan.py) runs a
plan on natural-order arrays.
"""

from lctx.parallel.attention_memory import AttentionDims
from lctx.parallel.context import (
  choose_strategy,
  make_attention_fn,
  validate_context_parallel,
  zigzag_inverse,
  zigzag_reorder,
)
from lctx.parallel.local import local_attention_fn
from lctx.parallel.mesh import (
  LOGICAL_RULES,
  MESH_AXES,
  MeshConfig,
  batch_sharding,
  make_mesh,
  mesh_shape,
  resolve_mesh_shape,
)
from lctx.parallel.mixer import LAYER_TYPES, SequenceMixer, as_mixer
from lctx.parallel.options import ContextOptions
from lctx.parallel.plan import (
  PLAN_STRATEGIES,
  ContextPlan,
  context_attention,
  make_context_plan,
)

__all__ = [
  "LOGICAL_RULES",
  "MESH_AXES",
  "PLAN_STRATEGIES",
  "AttentionDims",
  "ContextOptions",
  "ContextPlan",
  "LAYER_TYPES",
  "SequenceMixer",
  "as_mixer",
  "MeshConfig",
  "batch_sharding",
  "choose_strategy",
  "context_attention",
  "local_attention_fn",
  "make_attention_fn",
  "make_context_plan",
  "make_mesh",
  "mesh_shape",
  "resolve_mesh_shape",
  "validate_context_parallel",
  "zigzag_inverse",
  "zigzag_reorder",
]
