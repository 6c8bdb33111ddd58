"""Causal depthwise short convolution (the q/k/v conv of GDN and KDA layers), packing-aware.

    out[b, t, c] = act(bias[c] + sum_w weight[w, c] * x[b, t - (W - 1) + w, c])

weight is `[W, C]`: transformers keeps it as `nn.Conv1d(C, C, W, groups=C)`'s
`[C, 1, W]`, so `weight = hf_weight[:, 0, :].T`. A tap that reaches before the
row, or into an earlier run of segment ids (a reset: a token whose id differs
from its predecessor's, as in lctx.kernels.delta_rule), reads 0. Outputs at
padding (segment id 0) are 0.

`halo` `[B, W-1, C]` (context parallelism): the W-1 tokens before the row, with
their `halo_segment_ids` `[B, W-1]` (None: they continue the row's first
segment); the reset rule runs over halo + row, so a halo token counts only if no
reset lies between it and the reading token.

Shapes: B batch, T length, C channels, W kernel width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = ("silu", None)


def short_conv(
  x, weight, bias=None, *, segment_ids=None, activation="silu", halo=None, halo_segment_ids=None
):
  """Causal depthwise conv. x `[B, T, C]`, weight `[W, C]`, bias `[C]` or None,
  segment_ids `[B, T]` int32 (0 = padding; None: one segment), activation 'silu' or
  None, halo `[B, W-1, C]` / halo_segment_ids `[B, W-1]` (see the module docstring).
  Returns `[B, T, C]` in x.dtype."""
  b, t, c = x.shape
  w = weight.shape[0]
  if weight.shape != (w, c):
    raise ValueError(f"short_conv: weight {weight.shape} must be [W, C] with C = {c}")
  if bias is not None and bias.shape != (c,):
    raise ValueError(f"short_conv: bias {bias.shape} must be [C] = {(c,)}")
  if activation not in ACTIVATIONS:
    raise ValueError(f"short_conv: activation {activation!r} is not one of {ACTIVATIONS}")
  if halo is not None and halo.shape != (b, w - 1, c):
    raise ValueError(f"short_conv: halo {halo.shape} must be [B, W-1, C] = {(b, w - 1, c)}")
  ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  if halo is None:
    halo = jnp.zeros((b, w - 1, c), x.dtype)
    # Before the row: a distinct run that the first token never reads.
    halo_ids, halo_valid = jnp.broadcast_to(ids[:, :1], (b, w - 1)), False
  else:
    halo_valid = True
    halo_ids = (
      jnp.broadcast_to(ids[:, :1], (b, w - 1))
      if halo_segment_ids is None
      else jnp.asarray(halo_segment_ids, jnp.int32)
    )
  full = jnp.concatenate([halo.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
  full_ids = jnp.concatenate([halo_ids, ids], axis=1)
  reset = jnp.concatenate([jnp.ones((b, 1), bool), full_ids[:, 1:] != full_ids[:, :-1]], axis=1)
  if not halo_valid:
    reset = reset.at[:, w - 1].set(True)
  run = jnp.cumsum(reset.astype(jnp.int32), axis=1)  # [B, W-1+T]
  out = jnp.zeros((b, t, c), jnp.float32)
  for tap in range(w):  # tap reads token t - (W-1) + tap
    src = jax.lax.slice_in_dim(full, tap, tap + t, axis=1)
    ok = jax.lax.slice_in_dim(run, tap, tap + t, axis=1) == run[:, w - 1 :]
    out = out + jnp.where(ok[..., None], src.astype(jnp.float32), 0.0) * weight[tap].astype(
      jnp.float32
    )
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  if activation == "silu":
    out = jax.nn.silu(out)
  if segment_ids is not None:
    out = jnp.where((ids != 0)[..., None], out, 0.0)
  return out.astype(x.dtype)
