"""The context plan: every decision about how one run splits its sequences.

`make_context_plan` is where the strategy is resolved (by auto.decide_strategy,
the one strategy decision, `auto` included), where the
load-balance default is applied, where the zigzag ring size is fixed and where
the attention kernel's platform is read from the mesh. The trainer, the loop,
the evals adapter (`logits_fn`), the benchmarks and the tests ask the
`ContextPlan` it returns:

    plan = make_context_plan(mesh, dims, seq_len=..., batch_size=..., strategy="auto")
    plan.strategy, plan.load_balance, plan.ring_size, plan.platform
    plan.attention_fn                      # the model's attention plug-in
    batch = plan.to_device_order(batch)    # host rows -> the order devices hold
    logits = plan.to_natural_order(logits) # and back (numpy or jax arrays)

Strategy 'none' is a strategy like the others: no context parallelism, the
kernel runs on whole sequences (XLA may still shard batch and heads).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

from jax.sharding import Mesh

from lctx.errors import ConfigError
from lctx.kernels import cpu_fused
from lctx.kernels.options import AttentionOptions
from lctx.parallel import mesh as mesh_lib
from lctx.parallel.auto import AttentionDims, decide_strategy
from lctx.parallel.context import make_attention_fn
from lctx.parallel.local import local_attention_fn
from lctx.parallel.validation import (
  PLAN_STRATEGIES,
  default_load_balance,
  validate_context_parallel,
  zigzag_ring_size,
)
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

log = logging.getLogger(__name__)


# The plan's name for the attention options (lctx/kernels/options.py): TrainConfig's
# attention settings; the plan adds the platform, the strategy the token order.
KernelOptions = AttentionOptions
_DEFAULT_KERNEL = AttentionOptions()


@dataclasses.dataclass(frozen=True)
class ContextPlan:
  """A resolved context-parallel plan for one mesh and one model.

  Attributes:
    mesh: the device mesh.
    strategy: one of PLAN_STRATEGIES ('auto' is resolved).
    load_balance: whether batches are held in zigzag order.
    ring_size: P of the zigzag reorder (the `context` axis size).
    platform: platform of the mesh devices ('cpu', 'gpu', 'tpu'): the kernels'
      'auto' backend picks for it, not for the host running Python.
    kernel: the attention options (backend, blocks); `attention_fn` hands them
      on with the mesh's platform.
    reason: why this strategy (the `auto` choice, or 'configured').
    head_chunks: ulysses/usp only: run attention in this many head stages
      (UPipe, lctx/parallel/upipe.py); None: all heads at once.
    stage_projections: with head_chunks, the model projects q/k/v and the
      output one head stage at a time (context.make_attention_fn).
  """

  mesh: Mesh
  strategy: str
  load_balance: bool
  ring_size: int
  platform: str
  kernel: AttentionOptions
  reason: str = "configured"
  head_chunks: int | None = None
  stage_projections: bool = False

  @property
  def context_degree(self) -> int:
    shape = mesh_lib.mesh_shape(self.mesh)
    return shape.get("context", 1) * shape.get("context_ulysses", 1)

  @property
  def attention_fn(self) -> Callable:
    """The model plug-in (docs/contracts.md) for batches in device order."""
    options = dataclasses.replace(self.kernel, platform=self.platform)
    if self.strategy == "none":
      return local_attention_fn(mesh=self.mesh, options=options)
    return make_attention_fn(
      self.mesh,
      self.strategy,
      options=options,
      load_balance=self.load_balance,
      ulysses_head_chunks=self.head_chunks,
      stage_projections=self.stage_projections,
    )

  def to_device_order(self, batch: Mapping[str, object], axis: int = 1) -> dict:
    """Natural token order -> the order the devices hold (zigzag when balancing),
    for every array of a batch (numpy on the host, or jax arrays)."""
    if not self.load_balance:
      return dict(batch)
    return {k: zigzag_reorder(v, self.ring_size, axis=axis) for k, v in batch.items()}

  def to_natural_order(self, x, axis: int = 1):
    """Device order -> natural token order along `axis` (e.g. logits)."""
    if not self.load_balance:
      return x
    return zigzag_inverse(x, self.ring_size, axis=axis)

  def describe(self) -> str:
    lb = "zigzag load balance" if self.load_balance else "no load balance"
    return (
      f"strategy {self.strategy} (context degree {self.context_degree}, {lb}, "
      f"kernel {self.kernel.backend} on {self.platform}): {self.reason}"
    )


def mesh_platform(mesh: Mesh) -> str:
  """The platform of the mesh's devices ('cpu', 'gpu', 'tpu')."""
  return mesh.devices.flat[0].platform


def make_context_plan(
  mesh: Mesh,
  dims: AttentionDims,
  *,
  seq_len: int,
  batch_size: int,
  strategy: str = "auto",
  load_balance: bool | None = None,
  kernel: AttentionOptions = _DEFAULT_KERNEL,
  memory_budget_bytes: int | None = None,
  head_chunks: int | None = None,
  stage_projections: bool = False,
) -> ContextPlan:
  """Resolves strategy (incl. 'auto'), load balance and ring size; validates.

  Raises ValueError naming the broken rule (lctx/parallel/validation.py) before
  anything compiles.
  """
  if strategy not in (*PLAN_STRATEGIES, "auto"):
    raise ConfigError(
      f"[unknown-strategy] context_parallel_strategy {strategy!r} is not one of "
      f"{(*PLAN_STRATEGIES, 'auto')}"
    )
  shape = mesh_lib.mesh_shape(mesh)
  degree = shape.get("context", 1) * shape.get("context_ulysses", 1)
  platform = mesh_platform(mesh)
  strategy, reason = decide_strategy(
    strategy,
    mesh_shape=shape,
    platform=platform,
    dims=dims,
    seq_len=seq_len,
    batch_size=batch_size,
    load_balance=load_balance,
    attention_backend=kernel.backend,
    memory_budget_bytes=memory_budget_bytes,
  )
  if load_balance is None:
    load_balance = default_load_balance(strategy)
  if strategy == "none":
    if degree > 1:
      raise ConfigError(
        "[none-needs-no-context] context_parallel_strategy='none' needs context = "
        f"context_ulysses = 1, got mesh {shape}"
      )
    if load_balance:
      raise ConfigError("[none-load-balance] strategy 'none' has no ring to balance")
    if head_chunks is not None or stage_projections:
      raise ConfigError(
        "[head-chunks] ulysses_head_chunks / ulysses_stage_projections stage the ulysses "
        "all-to-all; strategy 'none' has none"
      )
  else:
    validate_context_parallel(
      strategy=strategy,
      mesh_shape=shape,
      num_q_heads=dims.num_q_heads,
      num_kv_heads=dims.num_kv_heads,
      seq_len=seq_len,
      load_balance=load_balance,
    )
  if kernel.backend == "auto" and platform == "cpu" and not cpu_fused.available():
    log.warning(
      "attention: the fused C++ CPU kernel is unavailable (%s); float32 calls run "
      "the pure-JAX blockwise kernel",
      cpu_fused.unavailable_reason(),
    )
  plan = ContextPlan(
    mesh=mesh,
    strategy=strategy,
    load_balance=bool(load_balance),
    ring_size=zigzag_ring_size(shape),
    platform=platform,
    kernel=kernel,
    reason=reason,
    head_chunks=head_chunks,
    stage_projections=stage_projections,
  )
  log.info("context plan: %s", plan.describe())
  return plan
