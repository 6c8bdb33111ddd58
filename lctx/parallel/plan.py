"""The context plan: every decision about how one run splits its sequences.

`make_context_plan` is where the strategy is resolved (by auto.decide_strategy,
the one strategy decision, `auto` included), where the
load-balance default is applied, where the zigzag ring size is fixed and where
the attention kernel's platform is read from the mesh. The trainer, the loop,
the evals adapter (`logits_fn`), the benchmarks and the tests ask the
`ContextPlan` it returns:

    plan = make_context_plan(mesh, dims, seq_len=..., batch_size=...,
                             context=ContextOptions(strategy="auto"),
                             attention=AttentionOptions(block_q=1024))
    plan.strategy, plan.load_balance, plan.ring_size, plan.platform
    plan.context, plan.attention           # the resolved options objects
    plan.mixer                             # the model's sequence mixer (mixer.py)
    plan.attention_fn                      # its full-attention call
    batch = plan.to_device_order(batch)    # host rows -> the order devices hold
    logits = plan.to_natural_order(logits) # and back (numpy or jax arrays)

Strategy 'none' is a strategy like the others: no context parallelism, the
kernel runs on whole sequences (XLA may still shard batch and heads).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping

import jax.numpy as jnp
from jax.sharding import Mesh

from lctx.errors import ConfigError
from lctx.kernels import cpu_fused
from lctx.kernels.options import AttentionOptions, options_from
from lctx.parallel import mesh as mesh_lib
from lctx.parallel.auto import AttentionDims, decide_strategy
from lctx.parallel.context import make_attention_fn, stage_heads, zigzag_sharded
from lctx.parallel.local import local_attention_fn
from lctx.parallel.mixer import SequenceMixer
from lctx.parallel.options import ContextOptions
from lctx.parallel.validation import (
  PLAN_STRATEGIES,
  auto_load_balance,
  default_load_balance,
  validate_context_parallel,
  zigzag_ring_size,
)
from lctx.parallel.zigzag import zigzag_inverse, zigzag_reorder

log = logging.getLogger(__name__)


_DEFAULT_ATTENTION = AttentionOptions()
_DEFAULT_CONTEXT = ContextOptions()


class _LinearFnsOnUse:
  """The linear layers' ops (lctx.parallel.linear_context.make_linear_fns), built on
  first use: models without linear layers never meet its layout rules."""

  def __init__(self, mesh: Mesh, load_balance: bool):
    self._mesh, self._load_balance = mesh, load_balance

  @functools.cached_property
  def fns(self):
    from lctx.parallel.linear_context import make_linear_fns  # pylint: disable=g-import-not-at-top

    return make_linear_fns(self._mesh, load_balance=self._load_balance)

  def short_conv(self, *args, **kwargs):
    return self.fns.short_conv(*args, **kwargs)

  def delta_rule(self, *args, **kwargs):
    return self.fns.delta_rule(*args, **kwargs)

  def layer(self, *args, **kwargs):
    return self.fns.layer(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ContextPlan:
  """A resolved context-parallel plan for one mesh and one model.

  Attributes:
    mesh: the device mesh.
    context: the resolved ContextOptions: `strategy` one of PLAN_STRATEGIES
      ('auto' resolved), `load_balance` a bool (whether batches are held in
      zigzag order), `token_order` the batch's order (P: zigzag over the ring,
      0: natural), head stages as configured.
    attention: the AttentionOptions (backend, blocks) with the mesh's platform;
      `attention_fn` hands them on.
    ring_size: P of the zigzag reorder (the `context` axis size).
    platform: platform of the mesh devices ('cpu', 'gpu', 'tpu'): the kernels'
      'auto' backend picks for it, not for the host running Python.
    reason: why this strategy (the `auto` choice, or 'configured').
    seq_len: the length the plan was validated for.
  """

  mesh: Mesh
  context: ContextOptions
  attention: AttentionOptions
  ring_size: int
  platform: str
  reason: str = "configured"
  seq_len: int | None = None

  @property
  def strategy(self) -> str:
    return self.context.strategy

  @property
  def load_balance(self) -> bool:
    return bool(self.context.load_balance)

  @property
  def head_chunks(self) -> int | None:
    return self.context.head_chunks

  @property
  def context_degree(self) -> int:
    shape = mesh_lib.mesh_shape(self.mesh)
    return shape.get("context", 1) * shape.get("context_ulysses", 1)

  @functools.cached_property
  def attention_fn(self) -> Callable:
    """The full-attention call (docs/contracts.md) for batches in device order."""
    if self.strategy == "none":
      return local_attention_fn(self.attention, mesh=self.mesh)
    return make_attention_fn(
      self.mesh, self.context, self.attention, validated_seq_len=self.seq_len
    )

  @functools.cached_property
  def sliding_attention_fn(self) -> Callable | None:
    """The sliding-window layers' call: ring, all_gather and usp exchange only
    the keys the window reaches (lctx/parallel/halo.py); None: attention_fn."""
    if self.strategy not in ("ring", "all_gather", "usp"):
      return None
    return make_attention_fn(
      self.mesh, self.context, self.attention, validated_seq_len=self.seq_len, window_aware=True
    )

  @functools.cached_property
  def mixer(self) -> SequenceMixer:
    """The model's sequence-mixer plug-in for this plan (lctx/parallel/mixer.py)."""
    stages = None
    if self.context.stage_projections:
      stages = stage_heads(self.mesh, self.strategy, self.head_chunks)
    # Strategy 'none': None, the single-device kernels.
    linear = None if self.strategy == "none" else _LinearFnsOnUse(self.mesh, self.load_balance)
    return SequenceMixer(
      attention=self.attention_fn,
      sliding_attention=self.sliding_attention_fn,
      head_stages=stages,
      linear=linear,
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
      f"kernel {self.attention.backend} on {self.platform}): {self.reason}"
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
  context: ContextOptions = _DEFAULT_CONTEXT,
  attention: AttentionOptions = _DEFAULT_ATTENTION,
  memory_budget_bytes: int | None = None,
) -> ContextPlan:
  """Resolves strategy (incl. 'auto'), load balance and ring size; validates.

  context: the run's ContextOptions (strategy, load balance, head stages);
  attention: its AttentionOptions (backend, blocks). Raises a ConfigError
  naming the broken rule (lctx/parallel/validation.py) before anything compiles.
  This is where the rules are checked, once per plan: 'auto' checks each
  candidate as it chooses (auto.choose_strategy) and the plan holds the load
  balance its choice was checked with; a configured strategy is checked here.
  The plan's attention call does not check its own length again.
  """
  requested, load_balance = context.strategy, context.load_balance
  head_chunks, stage_projections = context.head_chunks, context.stage_projections
  if requested not in (*PLAN_STRATEGIES, "auto"):
    raise ConfigError(
      f"[unknown-strategy] context_parallel_strategy {requested!r} is not one of "
      f"{(*PLAN_STRATEGIES, 'auto')}"
    )
  shape = mesh_lib.mesh_shape(mesh)
  degree = shape.get("context", 1) * shape.get("context_ulysses", 1)
  platform = mesh_platform(mesh)
  strategy, reason = decide_strategy(
    requested,
    mesh_shape=shape,
    platform=platform,
    dims=dims,
    seq_len=seq_len,
    batch_size=batch_size,
    load_balance=load_balance,
    attention_backend=attention.backend,
    memory_budget_bytes=memory_budget_bytes,
  )
  if requested == "auto":
    load_balance = auto_load_balance(strategy, load_balance)
  elif load_balance is None:
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
        "[head-chunks] ContextOptions.head_chunks / stage_projections stage the heads of a "
        "context-parallel strategy (ulysses, usp; ring with stage_projections); strategy "
        "'none' has none"
      )
  else:
    if stage_projections:
      stage_heads(mesh, strategy, head_chunks)  # its own rules, before anything compiles
    if requested != "auto":  # auto checked its choice with these inputs
      validate_context_parallel(
        strategy=strategy,
        mesh_shape=shape,
        num_q_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads,
        seq_len=seq_len,
        load_balance=load_balance,
      )
  if attention.backend == "auto" and platform == "cpu" and not cpu_fused.available():
    log.warning(
      "attention: the fused C++ CPU kernel is unavailable (%s); float32 calls run "
      "the pure-JAX blockwise kernel",
      cpu_fused.unavailable_reason(),
    )
  ring_size = zigzag_ring_size(shape)
  plan = ContextPlan(
    mesh=mesh,
    context=dataclasses.replace(
      context,
      strategy=strategy,
      load_balance=bool(load_balance),
      token_order=ring_size if load_balance else 0,
    ),
    attention=dataclasses.replace(attention, platform=platform),
    ring_size=ring_size,
    platform=platform,
    reason=reason,
    seq_len=seq_len,
  )
  log.info("context plan: %s", plan.describe())
  return plan


def context_attention(
  q,
  k,
  v,
  *,
  mesh,
  strategy: str,
  segment_ids=None,
  causal=True,
  load_balance: bool = False,
  window_size=None,
  softmax_scale=None,
  positions=None,
  kernel_backend: str = "auto",
  block_q: int = 512,
  block_kv: int = 512,
  ulysses_head_chunks: int | None = None,
  options: AttentionOptions | None = None,
):
  """Context-parallel attention on global arrays in natural token order.

  The keyword edge of the path the trainer takes: a `make_context_plan` for these
  shapes (strategy resolved and validated there), the plan's attention call, and
  the zigzag reorder of the plan's device order done here with collective
  permutes of half-shards (never a gather of the sequence).

  Args:
    q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K, V]`; segment_ids `[B, T]` (0 =
    padding; None: one segment); positions `[B, T]` (None: arange), counting up
    by one inside every segment (the pipeline's; splash masks on that order).
    strategy: 'all_gather' | 'ulysses' | 'ring' | 'usp' | 'auto'.
    load_balance: zigzag-reorder with ring size = context before, and undo it
      after (the training path instead gets pre-reordered batches).
    ulysses_head_chunks: ulysses / usp head stages (UPipe;
      ContextOptions.head_chunks).
    options: the kernel settings as one AttentionOptions, instead of
      kernel_backend / block_q / block_kv (the mask stays in causal,
      window_size and softmax_scale).
  Returns:
    out `[B, T, N, V]` in natural order.
  """
  b, t, n, h = q.shape
  kernel = options_from(options, backend=kernel_backend, block_q=block_q, block_kv=block_kv)
  dims = AttentionDims(n, k.shape[2], h, v.shape[3], bytes_per_element=q.dtype.itemsize)
  plan = make_context_plan(
    mesh,
    dims,
    seq_len=t,
    batch_size=b,
    context=ContextOptions(
      strategy=strategy, load_balance=load_balance, head_chunks=ulysses_head_chunks
    ),
    attention=kernel,
  )
  rows = mesh_lib.mesh_shape(mesh)
  rows = rows.get("data", 1) * rows.get("fsdp", 1)
  if b % rows:
    raise ConfigError(f"[batch-divisible] batch ({b}) must be divisible by data x fsdp = {rows}")
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  segment_ids = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32), (b, t))
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, t))
  order = (q, k, v, segment_ids, positions)
  if plan.load_balance:
    order = tuple(zigzag_sharded(x, mesh, plan.ring_size) for x in order)
  q, k, v, segment_ids, positions = order
  out = plan.attention_fn(
    q,
    k,
    v,
    segment_ids=segment_ids,
    positions=positions,
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
  )
  if plan.load_balance:
    out = zigzag_sharded(out, mesh, plan.ring_size, inverse=True)
  return out
