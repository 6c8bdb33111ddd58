"""`ContextOptions`: how a run splits its sequences, beside the kernels' `AttentionOptions`.

`AttentionOptions` (lctx/kernels/options.py) says how one attention call runs on
one device; `ContextOptions` says how the strategies split the sequence over
the mesh's context axes. Both are bound in gin beside each other:

    TrainConfig.context_parallel_strategy = 'usp'
    TrainConfig.attention_options = @AttentionOptions()
    AttentionOptions.block_q = 1024
    TrainConfig.context_options = @ContextOptions()
    ContextOptions.head_chunks = 4

`TrainConfig.context_parallel_strategy` is the user's name for `strategy`
(MaxText's); TrainConfig fills it in (`TrainConfig.context()`). The plan
(lctx/parallel/plan.py) resolves 'auto' and the load-balance default and sets
`token_order`; the strategies read the resolved object. Frozen and made of plain
scalars, so it is hashable (a key of the strategies' compile cache). Invalid
values raise a ValueError naming the field when the object is made.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ContextOptions:
  """Context-parallel settings.

  Attributes:
    strategy: 'all_gather' | 'ulysses' | 'ring' | 'usp' | 'none' | 'auto'
      (TrainConfig.context_parallel_strategy).
    load_balance: zigzag reorder for causal load balance; None picks the
      strategy's default (on for ring and usp).
    head_chunks: ulysses / usp: run each layer's attention in this many head
      stages (UPipe: the all-to-all, kernel and inverse all-to-all of one head
      group at a time, buffers reused; lctx/parallel/upipe.py). None or 1: all
      heads at once.
    stage_projections: with head_chunks, each stage also projects its own
      q/k/v heads (and attention_output_gate's gate) and its share of the
      output projection (lctx/models/attention.py), so the layer's whole q,
      gate, attention output and their gradients are never held; K/V are re-projected and re-exchanged for
      every q stage. False: the stages slice the layer's projected q/k/v and
      exchange K/V once per GQA group.
    sub_chunks: ring only: cut each hop into sub_chunks x sub_chunks (q, kv)
      pairs, skipped independently, bounding the kernel's per-call
      temporaries. None: one call per hop up to split_above tokens; above it,
      pieces of at most piece_tokens, at most max_sub_chunks (the pairs run in
      one fori_loop).
    token_order: set by the plan, not by users: the order of the global
      sequence the strategies shard, when the batch is known to follow it
      (positions count up by one along the natural order inside every
      segment, as the data pipeline makes them): 0 = natural, P = zigzag over
      ring size P (lctx/kernels/token_order.py). None: unknown, so kernels that
      mask on the natural token index (splash) do not take calls with positions.
  """

  strategy: str = "auto"
  load_balance: bool | None = None
  head_chunks: int | None = None
  stage_projections: bool = False
  sub_chunks: int | None = None
  split_above: int = 4096
  piece_tokens: int = 2048
  max_sub_chunks: int = 8
  token_order: int | None = None

  def __post_init__(self):
    if not isinstance(self.strategy, str):
      raise ValueError(f"strategy must be a strategy name; got {self.strategy!r}")
    if self.load_balance not in (None, True, False):
      raise ValueError(f"load_balance must be None, True or False; got {self.load_balance!r}")
    for name, least in (("head_chunks", 1), ("sub_chunks", 1), ("token_order", 0)):
      value = getattr(self, name)
      if value is not None and (
        not isinstance(value, int) or isinstance(value, bool) or value < least
      ):
        raise ValueError(f"{name} must be None or an int >= {least}; got {value!r}")
    for name in ("split_above", "piece_tokens", "max_sub_chunks"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    object.__setattr__(self, "stage_projections", bool(self.stage_projections))
    if self.load_balance is not None:
      object.__setattr__(self, "load_balance", bool(self.load_balance))

  @property
  def call_head_chunks(self) -> int | None:
    """The head stages the attention call runs itself: head_chunks, unless the
    model projects per stage (then each call gets one stage's heads)."""
    return None if self.stage_projections else self.head_chunks
