"""Sequence-chunked MLP and cross-entropy: no `[tokens, large-dim]` buffer ever lives.

Long-context training has two `tokens x large-dimension` activations besides
attention: the MLP hidden `[B*T, F]` and the logits `[B*T, E]`. Both are computed
here chunk by chunk over tokens, so only `[chunk, F]` / `[chunk, E]` exist at once,
in the forward pass and in the backward pass.

Shapes (docs/contracts.md legend): B batch, T length (or one chunk's tokens), D d_model,
F MLP hidden, E vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _check_chunk_size(chunk_size) -> None:
  if chunk_size is not None and int(chunk_size) < 1:
    raise ValueError(f"chunk_size must be None or >= 1; got {chunk_size}")


# ---------------------------------------------------------------------------
# Chunked MLP
# ---------------------------------------------------------------------------


def chunked_mlp(fn: Callable[[jnp.ndarray], jnp.ndarray], x: jnp.ndarray, chunk_size):
  """Applies a per-token function over sequence chunks of x.

  Args:
    fn: pure per-token function `[B, c, D] -> [B, c, D']` (it may close over
      parameters; their gradients flow). It must not mix tokens.
    x: `[B, T, D]`.
    chunk_size: tokens per chunk along T; None or >= T applies fn once.

  Returns:
    fn(x) `[B, T, D']`. The chunks run in a lax.scan and the backward pass
    recomputes each chunk's hidden `[B, c, F]` rather than storing `[B, T, F]`.

  The chunks are strided: chunk i holds tokens i, i + n, i + 2n, ... (n chunks).
  With the sequence sharded in contiguous blocks over P devices, every device
  then holds c / P tokens of every chunk, so no chunk moves between devices.
  Contiguous chunks lay each chunk on one device, and XLA all-to-all'ed the
  whole [B, T, D] activation into chunk-sharded order (and back) on every call
  (v5p: bf16[16,1,64,512,4096] all-to-alls at Llama-8B, 32M tokens).
  """
  _check_chunk_size(chunk_size)
  b, t = x.shape[:2]
  if chunk_size is None or int(chunk_size) >= t:
    return fn(x)
  c = int(chunk_size)
  n_chunks = -(-t // c)
  pad = n_chunks * c - t
  if pad:  # per-token fn: padded rows are computed and dropped
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  # Token j n + i is row j of chunk i: [B, c, n, D] keeps T's sharding on c.
  x4 = x.reshape((b, c, n_chunks) + x.shape[2:])
  f, consts = jax.closure_convert(fn, jax.ShapeDtypeStruct((b, c) + x.shape[2:], x.dtype))
  y = _chunk_map(f, n_chunks, x4, *consts)
  y = y.reshape((b, n_chunks * c) + y.shape[3:])
  return y[:, :t] if pad else y


def _index(a, i):
  return jax.lax.dynamic_index_in_dim(a, i, axis=2, keepdims=False)


def _put(a, v, i):
  return jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunk_map(f, n, x4, *consts):
  """`[B, c, n, D] -> [B, c, n, D']`: f(chunk, *consts) on each chunk [:, :, i].

  Chunks are read and written in place along axis 2: no [n, B, c, D] copy of x,
  of the output or of their cotangents. The backward (custom, so that it reads
  the output cotangent in place too: differentiating the forward's in-place
  writes made XLA copy the whole cotangent) recomputes each chunk's forward,
  as jax.checkpoint would, and accumulates the consts' cotangents.
  """
  out = jax.eval_shape(f, _index(x4, 0), *consts)
  y0 = jnp.zeros(x4.shape[:3] + out.shape[2:], out.dtype)
  body = lambda y, i: (_put(y, f(_index(x4, i), *consts), i), None)  # noqa: E731
  return jax.lax.scan(body, y0, jnp.arange(n))[0]


def _chunk_map_fwd(f, n, x4, *consts):
  return _chunk_map(f, n, x4, *consts), (x4, consts)


def _chunk_map_bwd(f, n, res, dy):
  x4, consts = res

  def body(carry, i):
    dx, dconsts = carry
    _, vjp = jax.vjp(f, _index(x4, i), *consts)
    dxc, *dcs = vjp(_index(dy, i))
    dconsts = [a + d.astype(a.dtype) for a, d in zip(dconsts, dcs)]
    return (_put(dx, dxc, i), dconsts), None

  init = (jnp.zeros_like(x4), [jnp.zeros_like(a) for a in consts])
  (dx, dconsts), _ = jax.lax.scan(body, init, jnp.arange(n))
  return (dx, *dconsts)


_chunk_map.defvjp(_chunk_map_fwd, _chunk_map_bwd)


# ---------------------------------------------------------------------------
# Cross-entropy
# ---------------------------------------------------------------------------


def reference_cross_entropy(
  hidden, unembed, targets, loss_mask, *, chunk_size=None, z_loss: float = 0.0
):
  """Unchunked cross-entropy; materialises `[B, T, E]` logits. Same contract as
  chunked_cross_entropy (chunk_size is ignored)."""
  del chunk_size
  logits = jnp.einsum(
    "BTD,DE->BTE",
    hidden,
    unembed,
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
  )
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  w = loss_mask.astype(jnp.float32)
  sum_loss = jnp.sum((lse - tgt) * w)
  sum_z = z_loss * jnp.sum(jnp.square(lse) * w)
  return sum_loss, sum_z, jnp.sum(w)


def _chunk_logits(h_c, unembed):
  # [c, D] x [D, E] -> [c, E], float32 accumulation whatever the input dtype.
  return jnp.einsum(
    "TD,DE->TE",
    h_c,
    unembed,
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
  )


def _ce_forward(pro, h_chunks, unembed, t_chunks, pro_consts):
  """Per-token lse and target logit, `[n, c]` each, one chunk of logits at a time."""

  def body(_, xs):
    h_c, t_c = xs
    logits = _chunk_logits(pro(h_c, *pro_consts), unembed)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]
    return None, (lse, tgt)

  _, (lse, tgt) = jax.lax.scan(body, None, (h_chunks, t_chunks))
  return lse, tgt


def _identity(h_c):
  return h_c


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _ce_sums(pro, h_chunks, unembed, t_chunks, w_chunks, z_loss, *pro_consts):
  return _ce_sums_fwd(pro, h_chunks, unembed, t_chunks, w_chunks, z_loss, *pro_consts)[0]


def _ce_sums_fwd(pro, h_chunks, unembed, t_chunks, w_chunks, z_loss, *pro_consts):
  lse, tgt = _ce_forward(pro, h_chunks, unembed, t_chunks, pro_consts)
  out = (jnp.sum((lse - tgt) * w_chunks), z_loss * jnp.sum(jnp.square(lse) * w_chunks))
  # Residuals are O(tokens): inputs plus per-token lse and target logit.
  return out, (h_chunks, unembed, t_chunks, w_chunks, lse, tgt, pro_consts)


def _ce_sums_bwd(pro, z_loss, res, g):
  h_chunks, unembed, t_chunks, w_chunks, lse, tgt, pro_consts = res
  g_loss, g_z = g
  e = unembed.shape[1]

  def body(carry, xs):
    d_unembed, d_consts = carry
    h_in, t_c, w_c, lse_c = xs
    h_c, pro_vjp = jax.vjp(pro, h_in, *pro_consts)  # the prologue, recomputed
    logits = _chunk_logits(h_c, unembed)  # recomputed, [c, E]
    p = jnp.exp(logits - lse_c[:, None])
    # d(lse - tgt)/dlogits = p - onehot; d(lse^2)/dlogits = 2 lse p.
    coef_p = w_c * (g_loss + g_z * z_loss * 2.0 * lse_c)
    d_logits = p * coef_p[:, None] - (
      jax.nn.one_hot(t_c, e, dtype=jnp.float32) * (w_c * g_loss)[:, None]
    )
    d_logits = d_logits.astype(h_c.dtype)
    d_h = jnp.einsum(
      "TE,DE->TD",
      d_logits,
      unembed,
      preferred_element_type=jnp.float32,
      precision=jax.lax.Precision.HIGHEST,
    )
    d_unembed = d_unembed + jnp.einsum(
      "TD,TE->DE",
      h_c,
      d_logits,
      preferred_element_type=jnp.float32,
      precision=jax.lax.Precision.HIGHEST,
    )
    d_in, *d_cs = pro_vjp(d_h.astype(h_c.dtype))
    d_consts = [a + d.astype(a.dtype) for a, d in zip(d_consts, d_cs)]
    return (d_unembed, d_consts), d_in.astype(h_in.dtype)

  init = (jnp.zeros(unembed.shape, jnp.float32), [jnp.zeros_like(a) for a in pro_consts])
  (d_unembed, d_consts), d_h = jax.lax.scan(body, init, (h_chunks, t_chunks, w_chunks, lse))
  d_w = g_loss * (lse - tgt) + g_z * z_loss * jnp.square(lse)
  return (d_h, d_unembed.astype(unembed.dtype), None, d_w.astype(w_chunks.dtype), *d_consts)


_ce_sums.defvjp(_ce_sums_fwd, _ce_sums_bwd)


def chunked_cross_entropy(
  hidden, unembed, targets, loss_mask, *, chunk_size, z_loss: float = 0.0, prologue=None
):
  """Softmax cross-entropy over `hidden @ unembed`, never holding `[B*T, E]` logits.

  Args:
    hidden: `[B, T, D]` final hidden states (after the final norm, or before it
      with the norm as `prologue`).
    unembed: `[D, E]` output projection.
    targets: int32 `[B, T]`.
    loss_mask: `[B, T]` token weights (0 drops a token).
    chunk_size: tokens per chunk (over the flattened B*T tokens); None or >= B*T
      means one chunk.
    z_loss: coefficient of the z-loss `z_loss * lse^2` (PaLM); 0 disables it.
    prologue: optional pure per-token function `[c, D] -> [c, D]` applied to each
      chunk of hidden before the unembedding (the final norm: its float32
      values and cotangent then exist for one chunk). It may close over
      parameters; their gradients flow. It must not mix tokens.

  Returns:
    float32 sums `(sum_loss, sum_z_loss, sum_weights)`: sum_loss = sum_t w_t
    (lse_t - logit_t[target]), sum_z_loss = z_loss * sum_t w_t lse_t^2,
    sum_weights = sum_t w_t. The caller divides (mean loss = (sum_loss +
    sum_z_loss) / sum_weights). A custom VJP recomputes each chunk's logits in
    the backward pass; gradients flow to hidden, unembed and loss_mask.
  """
  _check_chunk_size(chunk_size)
  b, t, d = hidden.shape
  if unembed.ndim != 2 or unembed.shape[0] != d:
    raise ValueError(f"unembed must be [D={d}, E]; got {unembed.shape}")
  if targets.shape != (b, t) or loss_mask.shape != (b, t):
    raise ValueError(
      f"targets {targets.shape} and loss_mask {loss_mask.shape} must be [B, T] = {(b, t)}"
    )
  tokens = b * t
  c = tokens if chunk_size is None else min(int(chunk_size), tokens)
  n_chunks = -(-tokens // c)
  pad = n_chunks * c - tokens
  h = hidden.reshape(tokens, d)
  tg = targets.reshape(tokens).astype(jnp.int32)
  w = loss_mask.reshape(tokens).astype(jnp.float32)
  if pad:  # padded tokens carry weight 0
    h = jnp.pad(h, [(0, pad), (0, 0)])
    tg = jnp.pad(tg, [(0, pad)])
    w = jnp.pad(w, [(0, pad)])
  pro, consts = jax.closure_convert(
    prologue or _identity, jax.ShapeDtypeStruct((c, d), hidden.dtype)
  )
  sum_loss, sum_z = _ce_sums(
    pro,
    h.reshape(n_chunks, c, d),
    unembed,
    tg.reshape(n_chunks, c),
    w.reshape(n_chunks, c),
    float(z_loss),
    *consts,
  )
  return sum_loss, sum_z, jnp.sum(w)


# ---------------------------------------------------------------------------
# Per-token scores (evals): forward only, one chunk of logits at a time
# ---------------------------------------------------------------------------


def chunked_token_scores(
  hidden, unembed, targets, *, chunk_size, prologue=None, greedy=True, return_argmax=False
):
  """Per-token log-probability and greedy match of each target, never holding
  `[B*T, E]` logits: the evals' forward-only counterpart of chunked_cross_entropy.

  Args:
    hidden, unembed, targets, chunk_size, prologue: as chunked_cross_entropy.

  Returns:
    (logp float32 `[B, T]`: log softmax(hidden @ unembed)[target], correct bool
    `[B, T]`: argmax == target, ties to the lowest id as np.argmax; None with
    greedy=False, which skips the argmax, a pass over each chunk's logits), and
    with return_argmax the argmax ids int32 `[B, T]` third (greedy decoding).
  """
  _check_chunk_size(chunk_size)
  b, t, d = hidden.shape
  if unembed.ndim != 2 or unembed.shape[0] != d:
    raise ValueError(f"unembed must be [D={d}, E]; got {unembed.shape}")
  if targets.shape != (b, t):
    raise ValueError(f"targets {targets.shape} must be [B, T] = {(b, t)}")
  tokens = b * t
  c = tokens if chunk_size is None else min(int(chunk_size), tokens)
  n_chunks = -(-tokens // c)
  pad = n_chunks * c - tokens
  h = hidden.reshape(tokens, d)
  tg = targets.reshape(tokens).astype(jnp.int32)
  if pad:
    h = jnp.pad(h, [(0, pad), (0, 0)])
    tg = jnp.pad(tg, [(0, pad)])
  pro, consts = jax.closure_convert(
    prologue or _identity, jax.ShapeDtypeStruct((c, d), hidden.dtype)
  )

  def body(_, xs):
    h_c, t_c = xs
    logits = _chunk_logits(pro(h_c, *consts), unembed)  # [c, E]
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return None, (tgt - lse, top == t_c, top)

  _, (logp, correct, top) = jax.lax.scan(
    body, None, (h.reshape(n_chunks, c, d), tg.reshape(n_chunks, c))
  )
  shape = lambda x: x.reshape(-1)[:tokens].reshape(b, t)  # noqa: E731
  if return_argmax:
    return shape(logp), shape(correct), shape(top)
  return shape(logp), shape(correct)
