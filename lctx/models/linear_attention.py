"""Linear-attention token mixers: Gated DeltaNet (Qwen3.5 / Qwen3-Next) and Kimi Delta Attention.

Both layers project q, k, v, run a causal depthwise conv (width W, SiLU) over
each, L2-normalise q and k (q also scaled by K^-1/2), and run the gated delta
rule (lctx.kernels.delta_rule) with beta = sigmoid(x Wb):

  GDN: g = -exp(A_log) softplus(x Wa + dt_bias), one log decay per value head;
       out = RMSNorm(o) * silu(x Wz), then the output projection.
  KDA: g = -exp(A_log) softplus(x Wf_a Wf_b + dt_bias), one per head and key
       channel (a rank-K gate); out = RMSNorm(o) * sigmoid(x Wg_a Wg_b), then
       the output projection.

That is transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet and
KimiLinearDeltaAttention (lctx keeps q, k, v, z and the conv of each as separate
params; lctx.models.hf_layout maps the fused HF tensors). The conv and the delta
rule come from the mixer's `linear` ops (lctx.parallel.linear_context under
context parallelism: halos and state exchange); without them, the
single-device kernels. Both restart at every packed-document boundary
(segment ids) and give 0 at padding.

With ModelConfig.linear_chunk_size the layer runs whole over sequence chunks
(the mixer's `layer` op, lctx.parallel.linear_context.chunked_layer: the state and
the conv's last W-1 tokens carried), from the same per-token parts
(`LinearParts`: project, heads, finish), so only x and the output span the
sequence; the remat tags inside the layer are then not placed (its chunk bodies
are rematerialised).

Remat tags (ModelConfig.REMAT_TAGS): query_proj / key_proj / value_proj on what
the delta rule consumes (q and k with their Q heads), attention_out on its
output, out_proj on the layer's. Every per-token tensor over the whole sequence
is in the compute dtype (ModelConfig.dtype); float32 lives inside the delta
rule's chunks, the norms' elementwise passes and the small per-token gates
(g, beta).

Shapes legend (docs/contracts.md): B batch, T length, D d_model, Q q/k heads
(linear_num_key_heads), N value heads (linear_num_value_heads), G = N // Q,
K key head dim, V value head dim, W conv width.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lctx.kernels import flop_tags
from lctx.models.config import ModelConfig
from lctx.models.layers import constrain, fan_in_init, param
from lctx.parallel.linear_context import CONV_PARAMS, LinearParts, chunked_layer
from lctx.parallel.mixer import as_mixer

_L2_EPS = 1e-6  # transformers' l2norm (and fla's)
_QK_NAMES = ("act_batch", "act_seq", "act_heads", "act_head_dim")
_OUT_NAMES = ("act_batch", "act_seq", "act_embed")


class _LocalLinearOps:
  """The single-device ops (no context parallelism), with LinearFns' signatures."""

  @staticmethod
  def short_conv(x, weight, bias=None, *, segment_ids, activation="silu"):
    from lctx.kernels.short_conv import short_conv  # pylint: disable=g-import-not-at-top

    return short_conv(x, weight, bias, segment_ids=segment_ids, activation=activation)

  @staticmethod
  def delta_rule(q, k, v, g, beta, *, segment_ids):
    from lctx.kernels.delta_rule import delta_rule  # pylint: disable=g-import-not-at-top

    return delta_rule(q, k, v, g, beta, segment_ids=segment_ids)[0]

  @staticmethod
  def layer(parts, p, x, *, segment_ids, chunk_size):
    return chunked_layer(parts, p, x, segment_ids=segment_ids, chunk_size=chunk_size)


def linear_ops(mixer):
  """The mixer's linear ops (short_conv, delta_rule, layer), or the single-device kernels."""
  ops = as_mixer(mixer).linear
  return _LocalLinearOps if ops is None else ops


def l2_normalise(x, factor=1.0, dtype=None):
  """factor * x / sqrt(sum(x^2) + eps) over the last axis (transformers' l2norm),
  computed in float32 and returned in `dtype` (default x.dtype): one elementwise
  pass, so no float32 copy of x is stored."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + _L2_EPS) * factor
  return (x32 * inv).astype(dtype or x.dtype)


def gated_rms_norm(o, gate, scale, eps, activation, dtype=None):
  """RMSNorm of o `[..., V]` over V (float32) times scale `[V]`, times act(gate),
  returned in `dtype` (default o.dtype); the float32 math stays inside one
  elementwise pass (no stored float32 copy of o)."""
  o32 = o.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
  out = o32 * inv * scale.astype(jnp.float32) * activation(gate.astype(jnp.float32))
  return out.astype(dtype or o.dtype)


def _conv(ops, x, weight, segment_ids):
  """The causal conv + SiLU of one projection `[B, T, H, K]` (channels H*K)."""
  b, t, h, k = x.shape
  with flop_tags.linear_scope():
    y = ops.short_conv(x.reshape(b, t, h * k), weight, None, segment_ids=segment_ids)
  return y.reshape(b, t, h, k)


def _heads(c: ModelConfig, p, q, k, v):
  """The conv outputs -> what the delta rule reads: q, k `[B, T, Q, K]` L2-normed
  (q scaled by K^-1/2), v, all in the compute dtype. q and k keep their Q heads:
  the delta rule repeats them to the value heads one chunk at a time (value head j
  reads q/k head j // G)."""
  del p
  q = l2_normalise(q, c.linear_key_head_dim**-0.5, c.dtype)
  return q, l2_normalise(k, 1.0, c.dtype), v.astype(c.dtype)


def _run(mixer, c: ModelConfig, parts: LinearParts, p: dict, x, segment_ids):
  """A linear layer on x `[B, T, D]`: over sequence chunks of c.linear_chunk_size
  (the mixer's `layer` op: no per-token value but x and the output spans T), or
  whole (the mixer's short_conv and delta_rule, with the remat tags)."""
  ops = linear_ops(mixer)
  if c.linear_chunk_size:
    out = ops.layer(parts, p, x, segment_ids=segment_ids, chunk_size=c.linear_chunk_size)
    return checkpoint_name(constrain(out, _OUT_NAMES), "out_proj")
  raw_q, raw_k, raw_v, g, beta = parts.project(p, x)
  convs = [_conv(ops, r, p[n], segment_ids) for r, n in zip((raw_q, raw_k, raw_v), CONV_PARAMS)]
  q, k, v = (constrain(t, _QK_NAMES) for t in parts.heads(p, *convs))
  q, k, v = (
    checkpoint_name(q, "query_proj"),
    checkpoint_name(k, "key_proj"),
    checkpoint_name(v, "value_proj"),
  )
  with flop_tags.linear_scope():  # sizing reads the mixer's matmuls and exchange apart
    o = ops.delta_rule(q, k, v, g, beta, segment_ids=segment_ids)
  o = checkpoint_name(constrain(o, _QK_NAMES), "attention_out")
  return checkpoint_name(constrain(parts.finish(p, x, o), _OUT_NAMES), "out_proj")


class GatedDeltaNet(nn.Module):
  """Gated DeltaNet (Qwen3.5 / Qwen3-Next). x `[B, T, D]` -> `[B, T, D]`."""

  config: ModelConfig
  mixer: object

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    del positions  # the recurrence is its own position signal
    c = self.config
    d, hq, hv = c.d_model, c.linear_num_key_heads, c.linear_num_value_heads
    kd, vd, w = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    pd = c.param_dtype
    init = fan_in_init([0], [1, 2])
    wq = param(self, "wq", init, (d, hq, kd), ("embed", "kv_heads", "head_dim"), pd)
    wk = param(self, "wk", init, (d, hq, kd), ("embed", "kv_heads", "head_dim"), pd)
    wv = param(self, "wv", init, (d, hv, vd), ("embed", "heads", "head_dim"), pd)
    wz = param(self, "wz", init, (d, hv, vd), ("embed", "heads", "head_dim"), pd)
    wb = param(self, "wb", fan_in_init([0], [1]), (d, hv), ("embed", "heads"), pd)
    wa = param(self, "wa", fan_in_init([0], [1]), (d, hv), ("embed", "heads"), pd)
    conv_init = fan_in_init([0], [1])
    conv_q = param(self, "conv_q", conv_init, (w, hq * kd), ("conv_width", "kv_heads"), pd)
    conv_k = param(self, "conv_k", conv_init, (w, hq * kd), ("conv_width", "kv_heads"), pd)
    conv_v = param(self, "conv_v", conv_init, (w, hv * vd), ("conv_width", "heads"), pd)
    # transformers' init: dt_bias 1, A uniform in [0.01, 16] (A_log = log A).
    dt_bias = param(self, "dt_bias", nn.initializers.ones, (hv,), ("heads",), pd)
    a_log = param(self, "A_log", _log_uniform(0.01, 16.0), (hv,), ("heads",), pd)
    scale = param(self, "norm_scale", nn.initializers.ones, (vd,), ("head_dim",), pd)
    wo = param(
      self, "wo", fan_in_init([0, 1], [2]), (hv, vd, d), ("heads", "head_dim", "embed"), pd
    )

    p = dict(
      wq=wq,
      wk=wk,
      wv=wv,
      wz=wz,
      wb=wb,
      wa=wa,
      conv_q=conv_q,
      conv_k=conv_k,
      conv_v=conv_v,
      dt_bias=dt_bias,
      A_log=a_log,
      norm_scale=scale,
      wo=wo,
    )
    return _run(self.mixer, c, _gdn_parts(c), p, x, segment_ids)


def _gdn_parts(c: ModelConfig) -> LinearParts:
  """Gated DeltaNet as per-token functions of its params (lctx.parallel.linear_context)."""
  cd = c.dtype

  def project(p, x):
    proj = lambda name, eq: jnp.einsum(eq, x, p[name].astype(cd))  # noqa: E731
    beta = jax.nn.sigmoid(proj("wb", "BTD,DN->BTN").astype(jnp.float32))
    a = proj("wa", "BTD,DN->BTN").astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
      a + p["dt_bias"].astype(jnp.float32)
    )
    q, k = proj("wq", "BTD,DQK->BTQK"), proj("wk", "BTD,DQK->BTQK")
    return q, k, proj("wv", "BTD,DNV->BTNV"), g, beta

  def finish(p, x, o):
    z = jnp.einsum("BTD,DNV->BTNV", x, p["wz"].astype(cd))
    o = gated_rms_norm(o, z, p["norm_scale"], c.norm_eps, jax.nn.silu, cd)
    return jnp.einsum("BTNV,NVD->BTD", o, p["wo"].astype(cd))

  return LinearParts(project=project, heads=functools.partial(_heads, c), finish=finish)


class KimiDeltaAttention(nn.Module):
  """Kimi Delta Attention (Kimi Linear). x `[B, T, D]` -> `[B, T, D]`; Q = N heads."""

  config: ModelConfig
  mixer: object

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    del positions
    c = self.config
    d, n = c.d_model, c.linear_num_value_heads
    kd, vd, w = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    pd = c.param_dtype
    init = fan_in_init([0], [1, 2])
    wq = param(self, "wq", init, (d, n, kd), ("embed", "heads", "head_dim"), pd)
    wk = param(self, "wk", init, (d, n, kd), ("embed", "heads", "head_dim"), pd)
    wv = param(self, "wv", init, (d, n, vd), ("embed", "heads", "head_dim"), pd)
    conv_init = fan_in_init([0], [1])
    conv_q = param(self, "conv_q", conv_init, (w, n * kd), ("conv_width", "heads"), pd)
    conv_k = param(self, "conv_k", conv_init, (w, n * kd), ("conv_width", "heads"), pd)
    conv_v = param(self, "conv_v", conv_init, (w, n * vd), ("conv_width", "heads"), pd)
    wb = param(self, "wb", fan_in_init([0], [1]), (d, n), ("embed", "heads"), pd)
    # The forget gate: rank-K projection to one log decay per head and key channel.
    wf_a = param(self, "wf_a", fan_in_init([0], [1]), (d, kd), ("embed", "head_dim"), pd)
    wf_b = param(self, "wf_b", init, (kd, n, kd), ("head_dim", "heads", None), pd)
    dt_bias = param(self, "dt_bias", _kda_dt_bias, (n, kd), ("heads", "head_dim"), pd)
    a_log = param(self, "A_log", _log_uniform(1.0, 16.0), (n,), ("heads",), pd)
    # The output gate: rank-K projection to one gate per head and value channel.
    wg_a = param(self, "wg_a", fan_in_init([0], [1]), (d, kd), ("embed", "head_dim"), pd)
    wg_b = param(self, "wg_b", init, (kd, n, vd), ("head_dim", "heads", None), pd)
    scale = param(self, "norm_scale", nn.initializers.ones, (vd,), ("head_dim",), pd)
    wo = param(self, "wo", fan_in_init([0, 1], [2]), (n, vd, d), ("heads", "head_dim", "embed"), pd)

    p = dict(
      wq=wq,
      wk=wk,
      wv=wv,
      conv_q=conv_q,
      conv_k=conv_k,
      conv_v=conv_v,
      wb=wb,
      wf_a=wf_a,
      wf_b=wf_b,
      dt_bias=dt_bias,
      A_log=a_log,
      wg_a=wg_a,
      wg_b=wg_b,
      norm_scale=scale,
      wo=wo,
    )
    return _run(self.mixer, c, _kda_parts(c), p, x, segment_ids)


def _kda_parts(c: ModelConfig) -> LinearParts:
  """Kimi Delta Attention as per-token functions of its params."""
  cd = c.dtype

  def project(p, x):
    proj = lambda name, eq: jnp.einsum(eq, x, p[name].astype(cd))  # noqa: E731
    beta = jax.nn.sigmoid(proj("wb", "BTD,DN->BTN").astype(jnp.float32))
    f = jnp.einsum("BTK,KNJ->BTNJ", proj("wf_a", "BTD,DK->BTK"), p["wf_b"].astype(cd))
    f = f.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32))[:, None] * jax.nn.softplus(f)  # [B, T, N, K]
    q, k = proj("wq", "BTD,DNK->BTNK"), proj("wk", "BTD,DNK->BTNK")
    return q, k, proj("wv", "BTD,DNV->BTNV"), g, beta

  def finish(p, x, o):
    gate_a = jnp.einsum("BTD,DK->BTK", x, p["wg_a"].astype(cd))
    gate = jnp.einsum("BTK,KNV->BTNV", gate_a, p["wg_b"].astype(cd))
    o = gated_rms_norm(o, gate, p["norm_scale"], c.norm_eps, jax.nn.sigmoid, cd)
    return jnp.einsum("BTNV,NVD->BTD", o, p["wo"].astype(cd))

  return LinearParts(project=project, heads=functools.partial(_heads, c), finish=finish)


def _log_uniform(lo: float, hi: float):
  """log(A) for A uniform in [lo, hi] (transformers' A_log init)."""

  def init(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, lo, hi)).astype(dtype)

  return init


def _kda_dt_bias(key, shape, dtype=jnp.float32):
  """fla's / transformers' KDA init: softplus^-1 of dt log-uniform in [1e-3, 1e-1]."""
  dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
  dt = jnp.maximum(dt, 1e-4)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
