"""Attention layers (MHA/GQA/MQA and DeepSeek-V2 MLA) and the default plug-in.

The model never chooses how attention runs: each layer builds q/k/v and calls
the attention of its sequence mixer (lctx/parallel/mixer.py; a bare function
is the mixer of every attention layer), `attend(q, k, v, *, segment_ids,
positions, causal, window_size, softmax_scale)` (docs/contracts.md). K/V are
never repeated for GQA here.

Shapes legend (docs/contracts.md): B batch, T length, N q heads, K kv heads, G = N // K, H head dim
(q/k), V value head dim, D d_model, R MLA rope dim, C MLA latent (kv_lora_rank),
Q MLA query latent (q_lora_rank).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lctx import kernels
from lctx.kernels.remat_tags import TAGS_ATTRIBUTE
from lctx.models.config import ModelConfig, rotary_dim
from lctx.models.layers import constrain, fan_in_init, norm_of, param
from lctx.models.rope import apply_rope
from lctx.parallel.mixer import SequenceMixer, as_mixer

AttentionFn = Callable[..., jax.Array]


def _attention_call(mixer, window_size):
  """The mixer's call for a layer of this window (None: a full-attention layer)."""
  return as_mixer(mixer).attention_for(
    "full_attention" if window_size is None else "sliding_attention"
  )


def _tag_out(call, out):
  """The 'attention_out' remat tag, unless the call's kernels tag their own
  residuals (output and lse; lctx/kernels/remat_tags.py): one saved copy."""
  if getattr(call, TAGS_ATTRIBUTE, False):
    return out
  return checkpoint_name(out, "attention_out")


def reference_attention_fn(
  q, k, v, *, segment_ids, positions, causal=True, window_size=None, softmax_scale=None
):
  """Plain-jnp attention with the plug-in signature; materialises the scores.

  Args:
    q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K, V]` (N % K == 0: query head n
    reads kv head n // G). segment_ids, positions int32 `[B, T]` (0 = padding).
    The mask is `lctx.kernels.masking.visible`, the one rule every kernel applies.
  Returns: `[B, T, N, V]` in q.dtype; rows that see no key are 0.
  """
  return kernels.reference_attention(
    q,
    k,
    v,
    segment_ids=segment_ids,
    q_positions=positions,
    kv_positions=positions,
    causal=causal,
    window_size=window_size,
    softmax_scale=softmax_scale,
  )


def _rope(c: ModelConfig, x, positions, window_size: int | None = None):
  """RoPE on the first rotary_dim(c) dims of each head `[B, T, *, H]` (all of them
  unless partial_rotary_factor < 1, as transformers' apply_rotary_pos_emb), with
  the schedule of the layer's type (c.rope_of: Gemma 3's sliding layers differ)."""
  rot = rotary_dim(c)
  theta, scaling = c.rope_of(window_size)
  if rot == x.shape[-1]:
    return apply_rope(x, positions, theta, scaling)
  rotated = apply_rope(x[..., :rot], positions, theta, scaling)
  return jnp.concatenate([rotated, x[..., rot:]], axis=-1)


def _tag_qkv(q, k, v):
  """Remat tags (lctx.models.config.REMAT_TAGS) on what attention consumes."""
  return (
    checkpoint_name(q, "query_proj"),
    checkpoint_name(k, "key_proj"),
    checkpoint_name(v, "value_proj"),
  )


_Q_NAMES = ("act_batch", "act_seq", "act_heads", "act_head_dim")
_KV_NAMES = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
_OUT_NAMES = ("act_batch", "act_seq", "act_embed")


class GQAAttention(nn.Module):
  """Multi-head attention with K kv heads (K = N: MHA, 1: MQA, else GQA)."""

  config: ModelConfig
  mixer: SequenceMixer | AttentionFn
  window_size: int | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions, pre=None):
    """x `[B, T, D]` -> `[B, T, D]`. pre: an optional per-token function applied
    to x first (the layer's RMSNorm); with head stages each stage applies it
    inside its checkpoint, so the normed `[B, T, D]` is not kept through them."""
    c = self.config
    d, n, kh, h = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    init = fan_in_init([0], [1, 2])
    wq = param(self, "wq", init, (d, n, h), ("embed", "heads", "head_dim"), c.param_dtype)
    wk = param(self, "wk", init, (d, kh, h), ("embed", "kv_heads", "head_dim"), c.param_dtype)
    wv = param(self, "wv", init, (d, kh, h), ("embed", "kv_heads", "head_dim"), c.param_dtype)
    wo = param(
      self, "wo", fan_in_init([0, 1], [2]), (n, h, d), ("heads", "head_dim", "embed"), c.param_dtype
    )
    biases = None
    if c.qkv_bias:
      zeros = nn.initializers.zeros
      biases = (
        param(self, "bq", zeros, (n, h), ("heads", "head_dim"), c.param_dtype),
        param(self, "bk", zeros, (kh, h), ("kv_heads", "head_dim"), c.param_dtype),
        param(self, "bv", zeros, (kh, h), ("kv_heads", "head_dim"), c.param_dtype),
      )
    norms = None
    if c.qk_norm:
      # Declared here, applied in _attend (which may run inside a scan over stages).
      probe = jnp.zeros((h,), c.dtype)
      norm = lambda name: norm_of(c, name, "head_dim")(probe, as_function=True)  # noqa: E731
      norms = (norm("q_norm"), norm("k_norm"))
    wg = None
    if c.attention_output_gate:  # Qwen3.5's output gate, per head and channel
      wg = param(self, "wg", init, (d, n, h), ("embed", "heads", "head_dim"), c.param_dtype)
    head_stages = as_mixer(self.mixer).head_stages
    if head_stages is not None:
      return self._by_head_stages(
        x, segment_ids, positions, (wq, wk, wv, wo), biases, norms, wg, *head_stages(n, kh), pre
      )
    if pre is not None:
      x = pre(x)
    gate = None
    if wg is not None:
      gate = jax.nn.sigmoid(jnp.einsum("BTD,DNH->BTNH", x, wg.astype(c.dtype)))
    q = jnp.einsum("BTD,DNH->BTNH", x, wq.astype(c.dtype))
    k = jnp.einsum("BTD,DKH->BTKH", x, wk.astype(c.dtype))
    v = jnp.einsum("BTD,DKH->BTKH", x, wv.astype(c.dtype))
    if biases is not None:
      q, k, v = (t + b.astype(c.dtype) for t, b in zip((q, k, v), biases))
    out = self._attend(q, k, v, segment_ids, positions, norms, tag=True)
    out = _tag_out(_attention_call(self.mixer, self.window_size), out)  # [B, T, N, H]
    if gate is not None:
      out = out * gate.astype(out.dtype)
    return checkpoint_name(jnp.einsum("BTNH,NHD->BTD", out, wo.astype(c.dtype)), "out_proj")

  def _attend(self, q, k, v, segment_ids, positions, norms=None, tag=False):
    """(q/k norms,) RoPE on the projected q/k, then the plug-in; tag: the remat tags."""
    c = self.config
    if norms is not None:
      q, k = norms[0](q), norms[1](k)
    q = constrain(_rope(c, q, positions, self.window_size), _Q_NAMES)
    k = constrain(_rope(c, k, positions, self.window_size), _KV_NAMES)
    v = constrain(v, _KV_NAMES)
    if tag:
      q, k, v = _tag_qkv(q, k, v)
    call = _attention_call(self.mixer, self.window_size)
    out = call(
      q,
      k,
      v,
      segment_ids=segment_ids,
      positions=positions,
      causal=True,
      window_size=self.window_size,
      softmax_scale=None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar**-0.5,
    )
    return constrain(out, _Q_NAMES)

  def _by_head_stages(
    self, x, segment_ids, positions, weights, biases, norms, wg, q_heads, kv_heads, pre=None
  ):
    """UPipe with per-stage projections (ContextOptions.stage_projections).

    Stage g projects only its q heads `q_heads[g]` and kv heads `kv_heads[g]`
    (lctx.parallel.upipe.head_stages: the heads each device receives in that
    stage's all-to-all), runs the plug-in on them and adds its share of the
    output projection. With attention_output_gate (wg not None) the stage also
    projects its q heads' gate and multiplies its attention output by it. The
    stages are a scan whose body checkpoints everything but the running sum, so
    forward and backward hold one stage's q/k/v/gate/out and the layer's
    `[B, T, D]` output, never the layer's whole q, gate or attention output.
    pre (the layer's norm) runs inside each stage: the stages keep the layer's
    input, which the layer keeps anyway, rather than a normed copy of it.
    Shapes: q_heads `[S, N/S]`, kv_heads `[S, M]` int arrays.
    """
    c = self.config
    wq, wk, wv, wo = (w.astype(c.dtype) for w in weights)
    nq, m = q_heads.shape[1], kv_heads.shape[1]
    # One [D, (N/S + 2M (+ N/S)) H] matrix per stage: q, k, v (and the gate) come
    # out of one matmul, so the backward forms dx in one matmul, not several
    # [B, T, D] terms summed.
    blocks = [(wq, q_heads), (wk, kv_heads), (wv, kv_heads)]
    if wg is not None:
      blocks.append((wg.astype(c.dtype), q_heads))
    w_qkv = jnp.concatenate(
      [w[:, idx].reshape(w.shape[0], -1, idx.shape[1] * w.shape[2]) for w, idx in blocks],
      axis=-1,
    )
    h = wq.shape[2]
    # [S, D, F], [S, N/S, H, D] (and the biases [S, F]); F = (N/S + 2M (+ N/S)) H
    per_stage = (jnp.moveaxis(w_qkv, 1, 0), wo[q_heads])
    if biases is not None:
      bq, bk, bv = (b.astype(c.dtype) for b in biases)
      b_blocks = [b[idx].reshape(idx.shape[0], -1) for b, idx in
                  ((bq, q_heads), (bk, kv_heads), (bv, kv_heads))]  # fmt: skip
      if wg is not None:  # the gate has no bias
        b_blocks.append(jnp.zeros((q_heads.shape[0], nq * h), c.dtype))
      per_stage += (jnp.concatenate(b_blocks, axis=-1),)

    @jax.checkpoint
    def stage_out(w):
      w_qkv_g, wo_g = w[:2]
      qkv = jnp.einsum("BTD,DF->BTF", x if pre is None else pre(x), w_qkv_g)
      if len(w) > 2:
        qkv = qkv + w[2]
      lead = qkv.shape[:2]
      q = qkv[..., : nq * h].reshape(lead + (nq, h))
      k = qkv[..., nq * h : (nq + m) * h].reshape(lead + (m, h))
      v = qkv[..., (nq + m) * h : (nq + 2 * m) * h].reshape(lead + (m, h))
      out = self._attend(q, k, v, segment_ids, positions, norms)  # [B, T, N/S, H]
      if wg is not None:  # the stage's gate: the last N/S H columns
        gate = jax.nn.sigmoid(qkv[..., (nq + 2 * m) * h :].reshape(lead + (nq, h)))
        out = out * gate.astype(out.dtype)
      return jnp.einsum("BTNH,NHD->BTD", out, wo_g)

    # The sum is outside the checkpoint: its backward needs no stage's input.
    body = lambda y, w: (y + stage_out(w), None)  # noqa: E731
    y0 = constrain(jnp.zeros(x.shape, c.dtype), _OUT_NAMES)
    y, _ = jax.lax.scan(body, y0, per_stage)
    return checkpoint_name(constrain(y, _OUT_NAMES), "out_proj")


class MLAAttention(nn.Module):
  """DeepSeek-V2 multi-head latent attention with decoupled RoPE.

  q = [q_nope | rope(q_rope)] per head, from x directly or via a normed rank-Q
  latent. KV: x -> [latent C | shared key rope part R]; the normed latent is
  up-projected to k_nope and v per head; k = [k_nope | rope(k_rope) broadcast to
  every head]. The mixer's attention sees ordinary q/k/v with K = N heads, H = nope + R.
  """

  config: ModelConfig
  mixer: SequenceMixer | AttentionFn
  window_size: int | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    """x `[B, T, D]` -> `[B, T, D]`."""
    c = self.config
    d, n, r = c.d_model, c.num_heads, c.qk_rope_head_dim
    nope, vd, lat = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    pd, cd = c.param_dtype, c.dtype
    if as_mixer(self.mixer).head_stages is not None:
      raise ValueError(
        "[head-chunks] ContextOptions.stage_projections projects GQA/MHA heads; "
        "MLA layers take ContextOptions.head_chunks alone"
      )
    norm = lambda name, axis: norm_of(c, name, axis)  # noqa: E731

    if c.q_lora_rank:
      wq_a = param(self, "wq_a", fan_in_init([0], [1]), (d, c.q_lora_rank), ("embed", "q_lora"), pd)
      wq_b = param(
        self,
        "wq_b",
        fan_in_init([0], [1, 2]),
        (c.q_lora_rank, n, nope + r),
        ("q_lora", "heads", "head_dim"),
        pd,
      )
      q_lat = norm("q_norm", "q_lora")(jnp.einsum("BTD,DQ->BTQ", x, wq_a.astype(cd)))
      q = jnp.einsum("BTQ,QNH->BTNH", q_lat, wq_b.astype(cd))
    else:
      wq = param(
        self, "wq", fan_in_init([0], [1, 2]), (d, n, nope + r), ("embed", "heads", "head_dim"), pd
      )
      q = jnp.einsum("BTD,DNH->BTNH", x, wq.astype(cd))
    if c.mla_rope:
      q = jnp.concatenate(
        [q[..., :nope], apply_rope(q[..., nope:], positions, c.rope_theta, c.rope_scaling)], -1
      )

    wkv_a = param(self, "wkv_a", fan_in_init([0], [1]), (d, lat + r), ("embed", "kv_lora"), pd)
    wkv_b = param(
      self,
      "wkv_b",
      fan_in_init([0], [1, 2]),
      (lat, n, nope + vd),
      ("kv_lora", "heads", "head_dim"),
      pd,
    )
    wo = param(self, "wo", fan_in_init([0, 1], [2]), (n, vd, d), ("heads", "head_dim", "embed"), pd)
    kv_a = jnp.einsum("BTD,DC->BTC", x, wkv_a.astype(cd))  # [B, T, C + R]
    kv_lat = norm("kv_norm", "kv_lora")(kv_a[..., :lat])  # [B, T, C]
    k_rope = kv_a[:, :, None, lat:]  # [B, T, 1, R]
    if c.mla_rope:
      k_rope = apply_rope(k_rope, positions, c.rope_theta, c.rope_scaling)
    kv = jnp.einsum("BTC,CNH->BTNH", kv_lat, wkv_b.astype(cd))  # [B, T, N, nope + V]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + (r,))], -1)
    q, k = constrain(q, _Q_NAMES), constrain(k, _Q_NAMES)
    v = constrain(v, _Q_NAMES)
    q, k, v = _tag_qkv(q, k, v)
    call = _attention_call(self.mixer, self.window_size)
    out = call(
      q,
      k,
      v,
      segment_ids=segment_ids,
      positions=positions,
      causal=True,
      window_size=self.window_size,
      softmax_scale=(nope + r) ** -0.5,
    )
    out = _tag_out(call, constrain(out, _Q_NAMES))  # [B, T, N, V]
    return checkpoint_name(jnp.einsum("BTNV,NVD->BTD", out, wo.astype(cd)), "out_proj")
