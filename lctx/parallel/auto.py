"""The strategy decision: `decide_strategy`, and `auto`'s choice inside it.

`decide_strategy` is a pure function of the mesh shape, the platform, the
attention dims and the train options; the run's ContextPlan
(lctx/parallel/plan.py), `context_attention` and `--mode=plan`
(lctx/sizing/planner.py) all call it, so the planner predicts the strategy the
run takes.

REFERENCE.md section 2: all_gather while the gathered K/V fit; ulysses while the
heads divide (not for MLA, not MQA); usp when the mesh has a ulysses axis; ring
otherwise. Memory comes from lctx/parallel/attention_memory.py (the buffers
the whole-step memory model of lctx/sizing counts too): the strategy's
attention buffers while one layer runs backward, for the kernel the step runs
(`kernel`: attention_memory.KERNELS, resolved from AttentionOptions.backend
and the mesh's platform by attention_memory.resolve_kernel; splash on TPU
meshes), plus an optional caller-given activation cost per local token.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from lctx.errors import ConfigError
from lctx.parallel import attention_memory
from lctx.parallel.attention_memory import AttentionDims
from lctx.parallel.mesh import BATCH_AXES
from lctx.parallel.validation import (
  STRATEGIES,
  auto_load_balance,
  context_degrees,
  validate_context_parallel,
)

log = logging.getLogger(__name__)


def decide_strategy(
  strategy: str,
  *,
  mesh_shape: Mapping[str, int],
  platform: str,
  dims: AttentionDims,
  seq_len: int,
  batch_size: int,
  load_balance: bool | None = None,
  attention_backend: str = "auto",
  memory_budget_bytes: int | None = None,
) -> tuple[str, str]:
  """(strategy, reason) a run takes for TrainConfig.context_parallel_strategy.

  'auto' on a mesh without context axes is 'none'; 'auto' otherwise is
  choose_strategy's pick, sized with the buffers of the kernel the mesh's
  platform runs for `attention_backend` ('auto' is splash on TPU); any other
  name is taken as configured (validated by the caller). batch_size is the
  global batch; memory_budget_bytes: None = choose_strategy's default.
  """
  c, u = context_degrees(mesh_shape)
  if strategy != "auto":
    return strategy, "configured"
  if c * u == 1:
    return "none", "context degree 1: no context parallelism"
  batch_ways = math.prod(int(mesh_shape.get(a, 1)) for a in BATCH_AXES)
  return choose_strategy(
    mesh_shape=dict(mesh_shape),
    dims=dims,
    seq_len=seq_len,
    batch_per_device=max(1, batch_size // batch_ways),
    memory_budget_bytes=memory_budget_bytes,
    load_balance=load_balance,
    kernel=attention_memory.resolve_kernel(attention_backend, platform),
  )


def estimate_attention_bytes(
  strategy: str,
  *,
  mesh_shape: dict,
  dims: AttentionDims,
  seq_len: int,
  batch_per_device: int = 1,
  block_q: int = 512,
  block_kv: int = 512,
  kernel: str = "blockwise",
) -> int:
  """Per-device bytes of one attention layer's buffers
  (attention_memory.attention_buffer_bytes for `kernel`), plus
  dims.activation_bytes_per_token per local token."""
  c, u = context_degrees(mesh_shape)
  setup = attention_memory.AttentionSetup(
    strategy=strategy,
    mesh=dict(mesh_shape),
    seq_len=seq_len,
    dtype_bytes=dims.bytes_per_element,
    block_q=block_q,
    block_kv=block_kv,
    kernel=kernel,
  )
  if strategy not in attention_memory.STRATEGIES:
    raise ConfigError(f"[unknown-strategy] {strategy!r}")
  if kernel not in attention_memory.KERNELS:
    raise ConfigError(
      f"[unknown-kernel] attention kernel {kernel!r}; known: {attention_memory.KERNELS} "
      "(attention_memory.resolve_kernel maps attention_backend to one)"
    )
  attention = attention_memory.attention_buffer_bytes(dims, setup, rows=batch_per_device)
  t_local = seq_len // (c * u)
  return int(attention + batch_per_device * t_local * dims.activation_bytes_per_token)


def choose_strategy(
  *,
  mesh_shape: dict,
  dims: AttentionDims,
  seq_len: int,
  batch_per_device: int = 1,
  memory_budget_bytes: int | None = None,
  load_balance: bool | None = None,
  kernel: str = "blockwise",
) -> tuple[str, str]:
  """Returns (strategy, reason) for `context_parallel_strategy = 'auto'`; logs it.

  dims: the heads (MLA: v_head_dim != head_dim goes to ring), the activation
    bytes and the bytes per local token saved besides attention.

  memory_budget_bytes: per-device bytes available to attention; None = 4 GiB.
  load_balance: None checks each candidate with its default (on for causal
    ring/usp, off otherwise).
  kernel: the attention kernel the step runs (attention_memory.KERNELS), e.g.
    `attention_memory.resolve_kernel(attention_backend, platform)`: 'splash' on
    TPU meshes for 'auto'. Candidates are sized with its buffers.
  Raises ValueError listing every candidate's rejection if none is valid.
  """
  budget = 4 * 2**30 if memory_budget_bytes is None else int(memory_budget_bytes)
  mla = dims.v_head_dim != dims.head_dim
  rejected, valid = [], []
  for s in STRATEGIES:
    if mla and s in ("ulysses", "usp"):
      rejected.append(f"{s}: MLA heads go to ring")
      continue
    lb = auto_load_balance(s, load_balance)
    try:
      validate_context_parallel(
        strategy=s,
        mesh_shape=mesh_shape,
        num_q_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads,
        seq_len=seq_len,
        load_balance=lb,
      )
    except ValueError as err:
      rejected.append(f"{s}: {err}")
      continue
    est = estimate_attention_bytes(
      s,
      mesh_shape=mesh_shape,
      dims=dims,
      seq_len=seq_len,
      batch_per_device=batch_per_device,
      kernel=kernel,
    )
    valid.append((s, est))
    if est <= budget:
      reason = (
        f"{s}: estimated {est / 2**20:.1f} MiB per device fits the "
        f"{budget / 2**20:.0f} MiB budget"
        + (f"; skipped {'; '.join(rejected)}" if rejected else "")
      )
      log.info("context_parallel_strategy=auto chose %s", reason)
      return s, reason
    rejected.append(f"{s}: estimated {est / 2**20:.1f} MiB > budget")
  if not valid:
    raise ConfigError(
      "[auto-no-strategy] no context-parallel strategy is valid: " + " | ".join(rejected)
    )
  # The official rule takes all_gather only while the whole K/V fit; when
  # nothing fits, the sharded strategies (whose buffers fall with the degree)
  # are the way forward, so the smallest of those.
  sharded = [x for x in valid if x[0] != "all_gather"] or valid
  s, est = min(sharded, key=lambda x: x[1])
  reason = (
    f"{s}: nothing fits the {budget / 2**20:.0f} MiB budget; smallest estimate "
    f"{est / 2**20:.1f} MiB ({'; '.join(rejected)})"
  )
  log.warning("context_parallel_strategy=auto chose %s", reason)
  return s, reason


def smallest_context_degree(num_devices: int, **kwargs) -> int:
  """Smallest context degree (a divisor of num_devices, on the `context` axis alone)
  at which choose_strategy finds a strategy that fits; num_devices if none does.

  kwargs: choose_strategy's arguments except mesh_shape (and tensor via `tensor`).
  """
  tensor = int(kwargs.pop("tensor", 1))
  budget = kwargs.get("memory_budget_bytes")
  budget = 4 * 2**30 if budget is None else budget
  for c in range(2, num_devices + 1):
    if num_devices % c:
      continue
    try:
      s, reason = choose_strategy(mesh_shape={"context": c, "tensor": tensor}, **kwargs)
    except ValueError:
      continue
    if "nothing fits" not in reason:
      return c
  return num_devices
