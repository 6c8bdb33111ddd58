"""`auto`: pick the cheapest valid strategy whose per-device memory fits.

REFERENCE.md section 2: all_gather while the gathered K/V fit; ulysses while the
heads divide (not for MLA, not MQA); usp when the mesh has a ulysses axis; ring
otherwise. The memory model is a per-device, per-layer estimate of attention
K/V + q/out buffers (forward and backward), plus an optional caller-given
activation cost per local token; the planner can refine it later.
"""

from __future__ import annotations

import logging

from lctx.parallel.validation import context_degrees, validate_context_parallel

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
) -> int:
  """Per-device bytes of one attention layer's K/V, q/out and gradient buffers.

  Float32 (4 bytes) for gradient accumulators and ring output accumulators.
  """
  vd = head_dim if v_head_dim is None else v_head_dim
  c, u = context_degrees(mesh_shape)
  tp = int(mesh_shape.get("tensor", 1))
  n = num_q_heads // tp
  k = num_kv_heads // tp if num_kv_heads % tp == 0 else 1
  t_local = seq_len // (c * u)
  e = bytes_per_element
  qo = lambda tokens, heads: tokens * heads * (head_dim + vd) * e  # noqa: E731
  if strategy == "all_gather":
    # Whole-sequence K/V, plus the same in f32 for dK/dV before reduce-scatter.
    per = qo(t_local, n) + seq_len * k * (head_dim + vd) * (e + 4)
  elif strategy == "ulysses":
    per = qo(seq_len, n // c) + seq_len * (k // c) * (head_dim + vd) * (e + 4)
  elif strategy in ("ring", "usp"):
    a2a = u if strategy == "usp" else 1
    chunk = seq_len // c  # the ring block: one ring group's tokens
    # Current + in-flight K/V blocks, travelling f32 dK/dV (x2), f32 out acc.
    per = (
      qo(chunk, n // a2a)
      + chunk * (k // a2a) * (head_dim + vd) * (2 * e + 8)
      + chunk * (n // a2a) * vd * 4
    )
  else:
    raise ValueError(f"[unknown-strategy] {strategy!r}")
  return int(batch_per_device * (per + t_local * activation_bytes_per_token))


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
) -> tuple[str, str]:
  """Returns (strategy, reason) for `context_parallel_strategy = 'auto'`; logs it.

  memory_budget_bytes: per-device bytes available to attention; None = 4 GiB.
  load_balance: None checks each candidate with its default (on for causal
    ring/usp, off otherwise).
  Raises ValueError listing every candidate's rejection if none is valid.
  """
  budget = 4 * 2**30 if memory_budget_bytes is None else int(memory_budget_bytes)
  mla = v_head_dim is not None and v_head_dim != head_dim
  rejected, valid = [], []
  for s in _ORDER:
    if mla and s in ("ulysses", "usp"):
      rejected.append(f"{s}: MLA heads go to ring")
      continue
    lb = (s in ("ring", "usp")) if load_balance is None else (load_balance and s != "ulysses")
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
    raise ValueError(
      "[auto-no-strategy] no context-parallel strategy is valid: " + " | ".join(rejected)
    )
  s, est = min(valid, key=lambda x: x[1])
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
