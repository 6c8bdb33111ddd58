"""One check of strategy x mesh x heads x length x load balancing, before compile.

Every failure is a ConfigError (a ValueError) whose message starts with the rule's name in
brackets and gives the numbers, e.g.
`[ulysses-heads] q heads per tensor shard (6) must be divisible by ...`.
"""

from __future__ import annotations

from lctx.errors import ConfigError

# The context-parallel strategies, in cost order (least communication first):
# `auto` tries them in this order and `--mode=plan` searches them so.
STRATEGIES = ("all_gather", "ulysses", "usp", "ring")
# What a run's ContextPlan may hold: 'none' is no context parallelism.
PLAN_STRATEGIES = ("none", *STRATEGIES)
# Strategies that only use the `context` axis (the a2a/ring over the second axis is usp's).
_SINGLE_AXIS = ("ulysses", "ring")


def context_degrees(mesh_shape: dict) -> tuple[int, int]:
  """(context, context_ulysses) sizes; absent axes count as 1."""
  return int(mesh_shape.get("context", 1)), int(mesh_shape.get("context_ulysses", 1))


def zigzag_ring_size(mesh_shape: dict) -> int:
  """The ring size P the zigzag reorder uses: the `context` axis size.

  Chunk pair (r, 2P-1-r) lands on ring position r. For usp the pair is further
  split over the context_ulysses devices of ring group r, whose all-to-all puts it
  back together, so every ring group holds one early and one late chunk.
  """
  return context_degrees(mesh_shape)[0]


def default_load_balance(strategy: str, causal: bool = True) -> bool:
  """Zigzag is on by default for causal ring and usp, off otherwise."""
  return bool(causal) and strategy in ("ring", "usp")


def auto_load_balance(strategy: str, load_balance: bool | None) -> bool:
  """The load balance strategy 'auto' gives a candidate: the strategy's default
  when unset; a requested zigzag wherever there is a ring to balance (ulysses
  has none, so it runs unbalanced). auto checks each candidate with it, and the
  plan it makes holds it."""
  if load_balance is None:
    return default_load_balance(strategy)
  return bool(load_balance) and strategy != "ulysses"


def validate_context_parallel(
  *,
  strategy: str,
  mesh_shape: dict,
  num_q_heads: int,
  num_kv_heads: int,
  seq_len: int,
  load_balance: bool,
) -> None:
  """Raises ValueError naming the violated rule and the numbers; returns None if valid.

  Args:
    strategy: one of STRATEGIES ('auto' must be resolved by choose_strategy first).
    mesh_shape: axis name -> size, e.g. {'data': 2, 'context': 4}; absent axes are 1.
    num_q_heads, num_kv_heads: global head counts (N, K).
    seq_len: global sequence length T.
    load_balance: whether the batch is in zigzag order.
  """
  if strategy not in STRATEGIES:
    raise ConfigError(
      f"[unknown-strategy] context_parallel_strategy {strategy!r} is not one of "
      f"{STRATEGIES} ('auto' is resolved by choose_strategy before validation)"
    )
  c, u = context_degrees(mesh_shape)
  tp = int(mesh_shape.get("tensor", 1))
  n, k = int(num_q_heads), int(num_kv_heads)
  degree = c * u

  if strategy in _SINGLE_AXIS and u != 1:
    raise ConfigError(
      f"[single-context-axis] strategy {strategy!r} runs over the 'context' axis only; "
      f"context_ulysses must be 1, got {u} (use 'usp' for ring x ulysses)"
    )
  if strategy in ("ring", "ulysses") and c == 1:
    raise ConfigError(
      f"[context-degree] strategy {strategy!r} needs a context degree > 1; got context = {c}"
    )
  if strategy == "usp" and (c == 1 or u == 1):
    raise ConfigError(
      f"[usp-factors] usp needs ring degree (context) > 1 and ulysses degree "
      f"(context_ulysses) > 1; got context = {c}, context_ulysses = {u}"
    )
  if n % tp != 0:
    raise ConfigError(f"[tensor-heads] q heads ({n}) must be divisible by tensor ({tp})")
  if k % tp != 0 and k != 1:
    raise ConfigError(
      f"[tensor-heads] kv heads ({k}) must be divisible by tensor ({tp}) "
      f"(or be 1: MQA, replicated over tensor)"
    )
  if strategy in ("ulysses", "usp"):
    a2a = c if strategy == "ulysses" else u
    if k == 1:
      raise ConfigError(
        f"[ulysses-mqa] {strategy} all-to-all needs more than one kv head; MQA "
        f"(kv heads = 1) cannot be split over the ulysses degree {a2a}; use ring "
        f"or all_gather"
      )
    n_local, k_local = n // tp, k // tp
    if n_local % a2a != 0 or k_local % a2a != 0:
      raise ConfigError(
        f"[ulysses-heads] q heads per tensor shard ({n} / tensor {tp} = {n_local}) "
        f"and kv heads per tensor shard ({k} / {tp} = {k_local}) must both be "
        f"divisible by the ulysses degree {a2a}"
      )
  if load_balance:
    if strategy == "ulysses":
      raise ConfigError(
        "[ulysses-load-balance] ulysses work is already balanced (every device "
        "sees the full sequence); load_balance must be False"
      )
    if c % 2 != 0:
      raise ConfigError(
        f"[odd-ring-load-balance] zigzag load balancing needs an even ring size (context); got {c}"
      )
    if seq_len % (2 * c) != 0:
      raise ConfigError(
        f"[seq-divisible] with load balancing the sequence length ({seq_len}) must "
        f"be divisible by 2 x ring size (context) = 2 x {c} = {2 * c}"
      )
  if seq_len % degree != 0:
    raise ConfigError(
      f"[seq-divisible] sequence length ({seq_len}) must be divisible by the context "
      f"degree {degree} (context {c} x context_ulysses {u})"
    )
