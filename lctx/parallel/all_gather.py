"""all_gather context parallelism: keep the local Q chunk, gather the whole K/V.

Runs inside `jax.shard_map`. K, V, the kv segment ids and positions are gathered
over the sequence axes; autodiff of the tiled all_gather is a reduce-scatter, so
backward reduce-scatters dK/dV. Per-device memory grows with the full sequence.

Local shapes: q `[B, T/P, N, H]`, k `[B, T/P, K, H]`, v `[B, T/P, K, V]`,
seg/pos `[B, T/P]`; returns `[B, T/P, N, V]`.
"""

from __future__ import annotations

import jax

from lctx.kernels.options import AttentionOptions
from lctx.parallel import block_ops
from lctx.parallel.options import ContextOptions


def all_gather_attention_local(
  q, k, v, seg, pos, *, cfg: AttentionOptions, ctx: ContextOptions, axis_names: tuple[str, ...]
):
  if axis_names:
    k, v, kv_seg, kv_pos = (
      jax.lax.all_gather(x, axis_names, axis=1, tiled=True) for x in (k, v, seg, pos)
    )
    q_start = jax.lax.axis_index(axis_names) * q.shape[1]  # this shard of the sequence
  else:
    kv_seg, kv_pos = seg, pos
    q_start = 0
  layout = block_ops.token_layout(ctx, k.shape[1], q_start, 0)
  return block_ops.attend(
    q, k, v, q_seg=seg, kv_seg=kv_seg, q_pos=pos, kv_pos=kv_pos, cfg=cfg, layout=layout
  )
