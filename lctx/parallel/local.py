"""Attention without context parallelism: the kernel behind the model plug-in.

Used when the sequence is not split (strategy 'none'): XLA may still shard the
batch and heads; the kernel runs on whole sequences.
"""

from __future__ import annotations

from collections.abc import Callable

from lctx import kernels


def local_attention_fn(
  kernel_backend: str = "auto",
  block_q: int = 512,
  block_kv: int = 512,
  block_q_bwd: int | None = None,
  block_kv_bwd: int | None = None,
  platform: str | None = None,
) -> Callable:
  """The model plug-in (docs/contracts.md) calling `lctx.kernels`."""

  def attention_fn(
    q, k, v, *, segment_ids, positions, causal=True, window_size=None, softmax_scale=None
  ):
    kw = dict(
      segment_ids=segment_ids,
      q_positions=positions,
      kv_positions=positions,
      causal=causal,
      window_size=window_size,
      softmax_scale=softmax_scale,
    )
    return kernels.flash_attention(
      q,
      k,
      v,
      block_q=block_q,
      block_kv=block_kv,
      block_q_bwd=block_q_bwd,
      block_kv_bwd=block_kv_bwd,
      backend=kernel_backend,
      platform=platform,
      **kw,
    )

  return attention_fn
