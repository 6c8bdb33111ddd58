"""Head-chunked Ulysses (UPipe, "Untied Ulysses"): attention one head group at a time.

Plain ulysses turns every local head into a whole-sequence head at once, so a
device holds q, k, v, out (and the kernel's buffers) of the whole sequence for
n/A heads. Here the layer's attention runs in S stages (`ContextOptions.head_chunks`),
each moving only u = n / (A S) q heads per device through the all-to-all, the
kernel and the inverse all-to-all; the stages run in a `lax.scan`, so their
buffers are reused and the attention working set is one stage's. K/V are
exchanged once per GQA group (w kv heads per device) and reused by every q stage
of that group. Each stage and each K/V group is a `jax.checkpoint`: the backward
recomputes them stage by stage instead of keeping every stage's buffers.

Head bookkeeping. A device's n local heads split into A contiguous groups (group
j goes to device j, as in plain ulysses, so q head i still reads kv head i // G).
Stage g takes heads [g u, (g + 1) u) of every group: a strided slice of the head
axis, viewed as `[A, S, u]`. K/V stage t takes kv heads [t w, (t + 1) w) of every
kv group the same way; with G = n / K q heads per kv head, u >= G means one q
stage per K/V group (w = u / G), u < G means G / u q stages share one kv head.

Shapes (local, inside shard_map): q `[B, T/A, n, H]`, k `[B, T/A, K, H]`,
v `[B, T/A, K, V]`, seg/pos `[B, T/A]` -> out `[B, T/A, n, V]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lctx.kernels.options import AttentionOptions
from lctx.kernels.shard_typing import varying_like
from lctx.parallel import block_ops
from lctx.parallel.options import ContextOptions


def _to_heads(x, axis):
  """`[B, T/A, m, D]` -> `[B, T, m/A, D]`."""
  return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_seq(x, axis):
  """`[B, T, m/A, D]` -> `[B, T/A, m, D]`."""
  return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def stage_shape(num_heads: int, num_kv_heads: int, degree: int, stages: int):
  """(u, w, q stages per K/V group) for `stages` stages of local heads, or a
  ValueError naming the rule that fails."""
  if num_heads % degree or num_kv_heads % degree:
    raise ValueError(
      f"[head-chunks] heads ({num_heads} q, {num_kv_heads} kv) must divide by the "
      f"ulysses degree {degree}"
    )
  per_device = num_heads // degree
  if stages < 1 or per_device % stages:
    raise ValueError(
      f"[head-chunks] head_chunks ({stages}) must divide the q heads per device after "
      f"the all-to-all ({num_heads} / {degree} = {per_device}); at most {per_device}"
    )
  u, g = per_device // stages, num_heads // num_kv_heads
  if u >= g:
    if u % g:
      raise ValueError(
        f"[head-chunks] {u} q heads per stage must be a multiple of the GQA group "
        f"({g} q heads per kv head) or divide it; head_chunks={stages}"
      )
    return u, u // g, 1
  if g % u:
    raise ValueError(
      f"[head-chunks] {u} q heads per stage must divide the GQA group ({g} q heads "
      f"per kv head); head_chunks={stages}"
    )
  return u, 1, g // u


def head_stages(num_heads: int, num_kv_heads: int, *, degree: int, stages: int):
  """Global head indices of each stage, for a model that projects q/k/v and the
  output one stage at a time (ContextOptions.stage_projections).

  Returns (q_heads `[S, A u]`, kv_heads `[S, A w]`) int arrays: stage g's q heads
  are heads j n/A + g u + [0, u) of every all-to-all group j (the heads device j
  receives, u of them), its kv heads those its q heads read (GQA: q head i reads
  kv head i // G) in the same group-major order, so that the unchunked strategy
  called on the stage sees an ordinary [A u] q / [A w] kv head problem. With
  u < G, G / u consecutive stages repeat the same kv heads.
  """
  u, w, per_kv = stage_shape(num_heads, num_kv_heads, degree, stages)
  n_grp, k_grp = num_heads // degree, num_kv_heads // degree
  q = np.array(
    [[j * n_grp + g * u + i for j in range(degree) for i in range(u)] for g in range(stages)]
  )
  kv = np.array(
    [
      [j * k_grp + (g // per_kv) * w + i for j in range(degree) for i in range(w)]
      for g in range(stages)
    ]
  )
  return q, kv


def upipe_attention_local(q, k, v, seg, pos, *, stages: int, axis_name: str, attend):
  """Head-chunked all-to-all attention over `axis_name`.

  attend(q, k, v, seg, pos) -> out: the whole-sequence attention of one stage
  (`[B, T, u, H]` ... -> `[B, T, u, V]`), e.g. the kernel (ulysses) or a ring over
  another axis (usp); seg/pos are already gathered over `axis_name`. stages: the
  head stages S (ContextOptions.head_chunks).
  """
  b, t_loc, n, h = q.shape
  kh, vd = k.shape[2], v.shape[3]
  a = jax.lax.axis_size(axis_name)
  stages = stages or 1
  u, w, per_kv = stage_shape(n, kh, a, stages)
  kv_stages = stages // per_kv
  # Strided head views: [.., A groups, stages, heads per stage, D].
  qv = q.reshape(b, t_loc, a, stages, u, h)
  kv_ = k.reshape(b, t_loc, a, kv_stages, w, h)
  vv = v.reshape(b, t_loc, a, kv_stages, w, vd)

  def pick(x, i):  # stage i's heads of every group, flattened as the all-to-all wants
    x = jax.lax.dynamic_index_in_dim(x, i, axis=3, keepdims=False)
    return x.reshape(x.shape[:2] + (-1, x.shape[-1]))

  @jax.checkpoint
  def q_stage(kf, vf, g):
    qf = _to_heads(pick(qv, g), axis_name)  # [B, T, u, H]
    out = attend(qf, kf, vf, seg, pos)  # [B, T, u, V]
    return _to_seq(out, axis_name).reshape(b, t_loc, a, 1, u, vd)

  def put(buf, out, g):  # into the preallocated output, in its final layout
    return jax.lax.dynamic_update_slice_in_dim(buf, out.astype(buf.dtype), g, axis=3)

  @jax.checkpoint
  def kv_stage(buf, t):
    kf = _to_heads(pick(kv_, t), axis_name)  # [B, T, w, H], once per K/V group
    vf = _to_heads(pick(vv, t), axis_name)
    if per_kv == 1:
      return put(buf, q_stage(kf, vf, t), t), None
    body = lambda buf, s: (put(buf, q_stage(kf, vf, t * per_kv + s), t * per_kv + s), None)  # noqa: E731
    return jax.lax.scan(body, buf, jnp.arange(per_kv))[0], None

  # [B, T/A, A groups, S stages, u, V]: stage g's heads of group j are heads
  # j n/A + g u + [0, u), so the final reshape is the original head order.
  buf = varying_like(jnp.zeros((b, t_loc, a, stages, u, vd), q.dtype), q, k, v)
  buf, _ = jax.lax.scan(kv_stage, buf, jnp.arange(kv_stages))
  return buf.reshape(b, t_loc, n, vd)


def ulysses_stage_attend(cfg: AttentionOptions, ctx: ContextOptions):
  """The kernel on one stage's whole sequence (plain ulysses' call)."""

  def attend(q, k, v, seg, pos):
    layout = block_ops.token_layout(ctx, q.shape[1], 0, 0)
    return block_ops.attend(
      q, k, v, q_seg=seg, kv_seg=seg, q_pos=pos, kv_pos=pos, cfg=cfg, layout=layout
    )

  return attend
