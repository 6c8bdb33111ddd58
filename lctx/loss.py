"""The loss and the eval scores over the final hidden states, each device over its own tokens.

The final norm and the unembedding run inside chunks of tokens
(lctx.kernels.chunked_cross_entropy / chunked_token_scores), in a shard_map over
the mesh's batch and sequence axes, so no device holds [tokens, vocab] logits
beyond one chunk. With the tensor axis in use (vocab-sharded logits), or on a
mesh with no batch or sequence axis, the plain SPMD path runs instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lctx.kernels import chunked_cross_entropy, chunked_token_scores
from lctx.parallel import mesh as mesh_lib


def token_axes(mesh):
  """(batch axes, sequence axes) of the mesh in use (size > 1), None for none."""
  shape = mesh_lib.mesh_shape(mesh)
  batch_axes = tuple(a for a in mesh_lib.BATCH_AXES if shape.get(a, 1) > 1) or None
  seq_axes = tuple(a for a in mesh_lib.SEQ_AXES if shape.get(a, 1) > 1) or None
  return batch_axes, seq_axes


def cross_entropy(
  mesh, hidden, final_norm, unembed, targets, loss_mask, *, chunk_size: int | None, z_loss: float
):
  """(sum_loss, sum_z, sum_weights) of the chunked cross-entropy of
  final_norm(hidden), each device over its own tokens.

  The final norm runs inside the loss chunks (chunked_cross_entropy's
  prologue): applied to the whole sequence, its float32 cotangent would be one
  [T, D] f32 value at the top of the backward pass (T: all the device's tokens).

  Under plain SPMD the chunks of the flattened global tokens would each lie on
  one device, and XLA would run every chunk on all devices with d_model split and the
  chunk's f32 logits all-reduced (at Llama-8B: [8192, 128256] f32 per chunk,
  4,096 chunks at 32M tokens). In a shard_map over the batch and sequence axes
  each device scans its own tokens (chunk_size per chunk) with the whole
  unembedding (gathered once from the d_model rows each device holds, as FSDP
  gathers any weight: `_gather_rows`), and only the three sums and the
  unembedding's gradient (reduce-scattered back to those rows) cross devices.
  With the tensor axis in use (vocab-sharded logits) the plain SPMD path stays.
  """

  # norm: a pytree (lctx.models.layers.RMSNormFn), so it crosses the shard_map.
  def fn(h, u, t, w, norm):
    return chunked_cross_entropy(h, u, t, w, chunk_size=chunk_size, z_loss=z_loss, prologue=norm)

  shape = mesh_lib.mesh_shape(mesh)
  axes = tuple(a for a in (*mesh_lib.BATCH_AXES, *mesh_lib.SEQ_AXES) if shape.get(a, 1) > 1)
  if not axes or shape.get("tensor", 1) > 1:
    return fn(hidden, unembed, targets, loss_mask, final_norm)
  batch_axes = tuple(a for a in mesh_lib.BATCH_AXES if a in axes) or None
  seq_axes = tuple(a for a in mesh_lib.SEQ_AXES if a in axes) or None
  tokens = P(batch_axes, seq_axes)
  split = unembed.shape[0] % math.prod(shape[a] for a in axes) == 0  # d_model rows per device

  def local(h, u, t, w, norm):
    if split:
      h, u = _gather_rows(h, u, axes)
    return tuple(jax.lax.psum(x, axes) for x in fn(h, u, t, w, norm))

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(P(batch_axes, seq_axes, None), P(axes if split else None, None), tokens, tokens, P()),
    out_specs=(P(), P(), P()),
    axis_names=set(axes),
    check_vma=False,
  )(hidden, unembed, targets, loss_mask, final_norm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_rows(h, u, axes):
  """(h, u's rows gathered over `axes`): the unembedding as the loss uses it,
  from the d_model rows each device holds (as FSDP holds its parameter).

  The backward reduce-scatters the unembedding's gradient in float32, to the
  rows each device holds, before the hidden states' cotangent goes on to the
  layers (an optimization barrier ties the two). Without it, the gradient left
  the shard_map whole and XLA all-reduced it late: the loss scan's f32
  [D, vocab] accumulator (3.79 GiB at Qwen3.5's 248,320-token vocabulary)
  stayed live through the layers' backward, at its peak."""
  return h, jax.lax.all_gather(u, axes, axis=0, tiled=True)


def _gather_rows_fwd(h, u, axes):
  return _gather_rows(h, u, axes), None


def _gather_rows_bwd(axes, _, ct):
  ct_h, ct_u = ct
  du = jax.lax.psum_scatter(ct_u.astype(jnp.float32), axes, scatter_dimension=0, tiled=True)
  ct_h, du = jax.lax.optimization_barrier((ct_h, du))
  return ct_h, du.astype(ct_u.dtype)


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def token_logp(mesh, hidden, final_norm, unembed, targets, *, chunk_size: int):
  """logp float32 [B, T] of each target under final_norm(hidden) @ unembed,
  chunk by chunk (lctx.kernels.chunked_token_scores, no argmax), sharded like
  cross_entropy: each device over its own tokens."""

  def fn(h, u, t, norm):
    return chunked_token_scores(h, u, t, chunk_size=chunk_size, prologue=norm, greedy=False)[0]

  batch_axes, seq_axes = token_axes(mesh)
  if not (batch_axes or seq_axes) or mesh_lib.mesh_shape(mesh).get("tensor", 1) > 1:
    return fn(hidden, unembed, targets, final_norm)
  tokens = P(batch_axes, seq_axes)
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(P(batch_axes, seq_axes, None), P(None, None), tokens, P()),
    out_specs=tokens,
    axis_names=set((batch_axes or ()) + (seq_axes or ())),
    check_vma=False,
  )(hidden, unembed, targets, final_norm)


def gather_positions(mesh, x, index):
  """x [B, T, C] (rows over the batch axes, T over the sequence axes) at
  index int32 [B, K] (global positions along T) -> [B, K, C].

  Each device picks the positions that fall in its own slice of T and the
  sequence axes sum the picks (one non-zero term each, so the sum is exact):
  only [B, K, C] moves, never x."""
  batch_axes, seq_axes = token_axes(mesh)
  if seq_axes is None:
    return jnp.take_along_axis(x, index[:, :, None], axis=1)

  def local(x, idx):
    n = x.shape[1]
    rel = idx - jax.lax.axis_index(seq_axes) * n
    inside = (rel >= 0) & (rel < n)
    picked = jnp.take_along_axis(x, jnp.clip(rel, 0, n - 1)[:, :, None], axis=1)
    return jax.lax.psum(jnp.where(inside[:, :, None], picked, jnp.zeros_like(picked)), seq_axes)

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(P(batch_axes, seq_axes, None), P(batch_axes, None)),
    out_specs=P(batch_axes, None, None),
    axis_names=set((batch_axes or ()) + seq_axes),
    check_vma=False,
  )(x, index)
