"""`auto`: pick the cheapest valid strategy whose per-device memory fits.

REFERENCE.md section 2: all_gather while the gathered K/V fit; ulysses while the
heads divide (not for MLA, not MQA); usp when the mesh has a ulysses axis; ring
otherwise. Memory comes from the planner's model (lctx/parallel/memory_model.py):
the strategy's attention buffers while one layer runs backward, for the kernel
the step runs (`kernel`: memory_model.KERNELS, resolved from
TrainConfig.attention_backend and the mesh's platform by
memory_model.resolve_kernel; splash on TPU meshes), plus an optional
caller-given activation cost per local token. `--mode=plan` uses the same model
for the whole step.
"""

from __future__ import annotations

import logging

from lctx.errors import ConfigError
from lctx.parallel import memory_model
from lctx.parallel.validation import (
  context_degrees,
  default_load_balance,
  validate_context_parallel,
)

log = logging.getLogger(__name__)

# Cost order: least communication first.
_ORDER = ("all_gather", "ulysses", "usp", "ring")


def estimate_attention_bytes(
  strategy: str,
  *,
  mesh_shape: dict,
  num_q_heads: int,
  num_kv_heads: int,
  seq_len: int,
  head_dim: int,
  v_head_dim: int | None = None,
  batch_per_device: int = 1,
  bytes_per_element: int = 2,
  activation_bytes_per_token: int = 0,
  block_q: int = 512,
  block_kv: int = 512,
  kernel: str = "blockwise",
) -> int:
  """Per-device bytes of one attention layer's buffers (memory_model's
  attention_buffer_bytes for `kernel`), plus activation_bytes_per_token per
  local token."""
  c, u = context_degrees(mesh_shape)
  dims = memory_model.ModelDims(
    vocab_size=0,
    d_model=0,
    num_layers=0,
    num_heads=num_q_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    v_head_dim=head_dim if v_head_dim is None else v_head_dim,
    mlp_dim=0,
    layer_params=0,
    embedding_params=0,
  )
  setup = memory_model.Setup(
    strategy=strategy,
    mesh=dict(mesh_shape),
    batch_size=batch_per_device,
    seq_len=seq_len,
    dtype_bytes=bytes_per_element,
    block_q=block_q,
    block_kv=block_kv,
    kernel=kernel,
  )
  if strategy not in memory_model.STRATEGIES:
    raise ConfigError(f"[unknown-strategy] {strategy!r}")
  if kernel not in memory_model.KERNELS:
    raise ConfigError(
      f"[unknown-kernel] attention kernel {kernel!r}; known: {memory_model.KERNELS} "
      "(memory_model.resolve_kernel maps attention_backend to one)"
    )
  attention = memory_model.attention_buffer_bytes(dims, setup, rows=batch_per_device)
  t_local = seq_len // (c * u)
  return int(attention + batch_per_device * t_local * activation_bytes_per_token)


def choose_strategy(
  *,
  mesh_shape: dict,
  num_q_heads: int,
  num_kv_heads: int,
  seq_len: int,
  head_dim: int,
  v_head_dim: int | None = None,
  batch_per_device: int = 1,
  bytes_per_element: int = 2,
  memory_budget_bytes: int | None = None,
  activation_bytes_per_token: int = 0,
  load_balance: bool | None = None,
  kernel: str = "blockwise",
) -> tuple[str, str]:
  """Returns (strategy, reason) for `context_parallel_strategy = 'auto'`; logs it.

  memory_budget_bytes: per-device bytes available to attention; None = 4 GiB.
  load_balance: None checks each candidate with its default (on for causal
    ring/usp, off otherwise).
  kernel: the attention kernel the step runs (memory_model.KERNELS), e.g.
    `memory_model.resolve_kernel(attention_backend, platform)`: 'splash' on
    TPU meshes for 'auto'. Candidates are sized with its buffers.
  Raises ValueError listing every candidate's rejection if none is valid.
  """
  budget = 4 * 2**30 if memory_budget_bytes is None else int(memory_budget_bytes)
  mla = v_head_dim is not None and v_head_dim != head_dim
  rejected, valid = [], []
  for s in _ORDER:
    if mla and s in ("ulysses", "usp"):
      rejected.append(f"{s}: MLA heads go to ring")
      continue
    lb = default_load_balance(s) if load_balance is None else (load_balance and s != "ulysses")
    try:
      validate_context_parallel(
        strategy=s,
        mesh_shape=mesh_shape,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        seq_len=seq_len,
        load_balance=lb,
      )
    except ValueError as err:
      rejected.append(f"{s}: {err}")
      continue
    est = estimate_attention_bytes(
      s,
      mesh_shape=mesh_shape,
      num_q_heads=num_q_heads,
      num_kv_heads=num_kv_heads,
      seq_len=seq_len,
      head_dim=head_dim,
      v_head_dim=v_head_dim,
      batch_per_device=batch_per_device,
      bytes_per_element=bytes_per_element,
      activation_bytes_per_token=activation_bytes_per_token,
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
