"""Mesh, logical-axis rules and the context-parallel attention strategies."""

from lctx.parallel.context import (
  choose_strategy,
  context_attention,
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

__all__ = [
  "LOGICAL_RULES",
  "MESH_AXES",
  "MeshConfig",
  "batch_sharding",
  "choose_strategy",
  "context_attention",
  "local_attention_fn",
  "make_attention_fn",
  "make_mesh",
  "mesh_shape",
  "resolve_mesh_shape",
  "validate_context_parallel",
  "zigzag_inverse",
  "zigzag_reorder",
]
