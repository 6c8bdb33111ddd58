"""Mesh, logical-axis rules and the context-parallel attention strategies."""
from lctx.parallel.local import local_attention_fn
from lctx.parallel.mesh import (LOGICAL_RULES, MESH_AXES, MeshConfig,
                                batch_sharding, make_mesh, mesh_shape,
                                resolve_mesh_shape)

try:  # The strategies land in lctx/parallel/context.py.
  from lctx.parallel.context import (choose_strategy, context_attention,
                                     make_attention_fn,
                                     validate_context_parallel,
                                     zigzag_inverse, zigzag_reorder)
except ImportError:  # pragma: no cover - transitional, removed once it lands
  pass
