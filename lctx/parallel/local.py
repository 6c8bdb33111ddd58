"""Attention without context parallelism: the kernel behind the model plug-in.

Used when the sequence is not split (strategy 'none'): XLA may still shard the
batch and heads; the kernel runs on whole sequences.

The batch is in natural token order (strategy 'none' has no ring to balance),
and the data pipeline's positions count up by one along it inside every segment
(packed rows, 'absolute' or 'restart' positions; see make_attention_fn in
lctx/parallel/context.py). The plug-in says so to the kernels with a
natural-order token layout, as the context strategies do with
load_balance=False, so that splash, which masks on the natural token index,
takes the calls although positions are passed ('auto' on TPU).

Splash is a Pallas kernel, which XLA cannot partition: where it runs, the call
goes through a shard_map over the mesh, batch over (data, fsdp) and heads over
tensor where they divide (kv heads replicated over tensor when they do not,
e.g. MQA), whole sequences per device. The other kernels stay under XLA's
sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from lctx import kernels
from lctx.kernels.options import AttentionOptions
from lctx.kernels.remat_tags import TAGS_ATTRIBUTE
from lctx.kernels.token_order import Layout, TokenOrder
from lctx.parallel.mesh import BATCH_AXES, LOGICAL_RULES, mesh_shape, shard_map_over

HEAD_AXIS = dict(LOGICAL_RULES)["act_heads"]
_DEFAULT_OPTIONS = AttentionOptions()


def _divides(mesh, axes, n: int):
  """The axes of `axes` present in the mesh if their product divides n, else None."""
  shape = mesh_shape(mesh)
  names = tuple(a for a in axes if a in shape)
  ways = 1
  for a in names:
    ways *= shape[a]
  return names if names and n % ways == 0 else None


def _sharded_splash(mesh, call, q, k, v, segment_ids, positions):
  """call(q, k, v, segment_ids, positions) on each device's rows and heads."""
  batch = _divides(mesh, BATCH_AXES, q.shape[0])
  q_head = _divides(mesh, (HEAD_AXIS,), q.shape[2])
  kv_head = _divides(mesh, (HEAD_AXIS,), k.shape[2]) if q_head else None
  q_spec, kv_spec, tok_spec = P(batch, None, q_head), P(batch, None, kv_head), P(batch, None)
  specs = (q_spec, kv_spec, kv_spec, tok_spec, tok_spec)
  return shard_map_over(call, mesh, specs, q_spec)(q, k, v, segment_ids, positions)


def local_attention_fn(
  options: AttentionOptions = _DEFAULT_OPTIONS,
  *,
  natural_order: bool = True,
  mesh=None,
) -> Callable:
  """The model plug-in (docs/contracts.md) calling `lctx.kernels`.

  options: the attention options (the plan's: backend, blocks, platform); the
    model's call adds the mask (causal, window, scale).
  natural_order: the batches follow the natural token order, positions counting
    up by one along each row inside every segment (the pipeline's batches).
    False: positions are arbitrary, so kernels that mask on the natural token
    index (splash) do not take calls with positions (blockwise runs instead).
  mesh: the mesh the batch is sharded over (None: the mesh set by
    `jax.set_mesh` at trace time, if any); splash runs in a shard_map over it.
  """
  base = options

  def attention_fn(
    q, k, v, *, segment_ids, positions, causal=True, window_size=None, softmax_scale=None
  ):
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    opts = base.with_mask(causal, window_size, softmax_scale)
    layout = Layout(TokenOrder(t)) if natural_order and t == s else None
    backend = kernels.choose_backend(
      q,
      k,
      v,
      backend=opts.backend,
      platform=opts.platform,
      segment_ids=segment_ids,
      positions_given=positions is not None,
      window_size=opts.window_size,
      layout=layout,
    )
    opts = dataclasses.replace(opts, backend=backend)

    def call(q, k, v, segment_ids, positions):
      return kernels.flash_attention(
        q,
        k,
        v,
        segment_ids=segment_ids,
        q_positions=positions,
        kv_positions=positions,
        options=opts,
        layout=layout,
      )

    m = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    inside_shard_map = bool(jax.sharding.get_abstract_mesh().manual_axes)
    if backend != "splash" or m.empty or inside_shard_map:
      return call(q, k, v, segment_ids, positions)
    if segment_ids is None:
      segment_ids = jax.numpy.ones((b, t), jax.numpy.int32)
    if positions is None:
      positions = jax.numpy.broadcast_to(jax.numpy.arange(t, dtype=jax.numpy.int32), (b, t))
    return _sharded_splash(m, call, q, k, v, segment_ids, positions)

  setattr(attention_fn, TAGS_ATTRIBUTE, True)  # flash_attention tags (remat_tags.py)
  return attention_fn
