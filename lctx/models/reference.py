"""A straightforward forward pass in plain jnp, for tests only.

Deliberately written differently from the Flax model so the two can check each
other: a Python loop over layers, RoPE through complex numbers, K/V heads
repeated explicitly for GQA, the mask built token by token from the definitions,
everything in float32 (jitted only for test speed). Reads the scanned params layout
(`params['layers']['layer_{i}'][...]` with a leading repeat axis).

Shapes legend (docs/contracts.md): B batch, T length, N q heads, K kv heads, H head
dim, D d_model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from lctx.models import rope
from lctx.models.config import ModelConfig


def _rms(x, scale, eps):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x, positions, c: ModelConfig):
  """x `[B, T, N, H]`: pairs (i, i + H/2) rotated as complex numbers (angles as
  float32 products: exact only at small positions, which is what tests use)."""
  h = x.shape[-1]
  freq = rope.inv_frequencies(h, c.rope_theta, c.rope_scaling_dict).astype(np.float32)
  mult = rope.attention_factor(c.rope_scaling_dict)
  rot = mult * jnp.exp(1j * positions[..., None, None].astype(jnp.float32) * freq)  # [B, T, 1, H/2]
  z = (x[..., : h // 2] + 1j * x[..., h // 2 :]) * rot
  return jnp.concatenate([z.real, z.imag], -1)


def _mask(segment_ids, positions, window):
  """Boolean `[B, T, S]` built from the rules in docs/contracts.md."""
  seg, pos = np.asarray(segment_ids), np.asarray(positions)
  b, t = seg.shape
  vis = np.zeros((b, t, t), bool)
  for bi in range(b):
    for i in range(t):
      for j in range(t):
        same = seg[bi, i] == seg[bi, j] and seg[bi, i] != 0
        causal = pos[bi, j] <= pos[bi, i]
        in_window = window is None or pos[bi, j] > pos[bi, i] - window
        vis[bi, i, j] = same and causal and in_window
  return jnp.asarray(vis)


def _attend(q, k, v, vis, scale):
  """q `[B, T, N, H]`, k `[B, T, N, H]`, v `[B, T, N, V]` (already one kv per head)."""
  s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * scale
  s = jnp.where(vis[:, None], s, -1e30)
  p = jnp.exp(s - s.max(-1, keepdims=True)) * vis[:, None]
  denom = p.sum(-1, keepdims=True)
  p = p / jnp.where(denom == 0, 1.0, denom)
  return jnp.einsum("BNTS,BSNV->BTNV", p, v)


def _gqa(p, x, pos, vis, c):
  q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
  k = jnp.einsum("BTD,DKH->BTKH", x, p["wk"])
  v = jnp.einsum("BTD,DKH->BTKH", x, p["wv"])
  if c.qkv_bias:
    q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
  if c.qk_norm:
    q = _rms(q, p["q_norm"]["scale"], c.norm_eps)
    k = _rms(k, p["k_norm"]["scale"], c.norm_eps)
  q, k = _rope(q, pos, c), _rope(k, pos, c)
  rep = c.num_heads // c.num_kv_heads
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  out = _attend(q, k, v, vis, c.head_dim**-0.5)
  return jnp.einsum("BTNH,NHD->BTD", out, p["wo"])


def _mla(p, x, pos, vis, c):
  nope, r, lat = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
  if c.q_lora_rank:
    q = _rms(x @ p["wq_a"], p["q_norm"]["scale"], c.norm_eps)
    q = jnp.einsum("BTQ,QNH->BTNH", q, p["wq_b"])
  else:
    q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
  q = jnp.concatenate([q[..., :nope], _rope(q[..., nope:], pos, c)], -1)
  kv_a = x @ p["wkv_a"]
  latent = _rms(kv_a[..., :lat], p["kv_norm"]["scale"], c.norm_eps)
  k_rope = _rope(kv_a[..., None, lat:], pos, c)  # [B, T, 1, R]
  kv = jnp.einsum("BTC,CNH->BTNH", latent, p["wkv_b"])
  k_rope = jnp.tile(k_rope, (1, 1, c.num_heads, 1))
  k = jnp.concatenate([kv[..., :nope], k_rope], -1)
  out = _attend(q, k, kv[..., nope:], vis, (nope + r) ** -0.5)
  return jnp.einsum("BTNV,NVD->BTD", out, p["wo"])


def reference_forward(
  params, config: ModelConfig, inputs, positions, segment_ids, return_hidden: bool = False
):
  """logits `[B, T, E]` float32 (or final-normed hidden `[B, T, D]`), all in f32.
  Llama-family layers only: Gemma's layer fields are checked against transformers
  (tests/test_hf.py) instead."""
  gemma = ("norm_plus_one", "embed_scale", "post_sublayer_norms", "query_pre_attn_scalar",
           "sliding_rope_theta", "final_logit_softcap")  # fmt: skip
  if config.mlp_activation != "silu" or any(getattr(config, f) for f in gemma):
    raise ValueError("reference_forward computes Llama-family layers; this config has Gemma's")
  params = nn.unbox(params)
  params = params.get("params", params)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), dict(params))
  masks = tuple(_mask(segment_ids, positions, w) for w in config.attention_pattern)
  return _forward(params, config, jnp.asarray(inputs), jnp.asarray(positions), masks, return_hidden)


@functools.partial(jax.jit, static_argnums=(1, 5))
def _forward(params, c, inputs, positions, masks, return_hidden):
  x = params["embedding"][inputs]
  attn = _mla if c.attention == "mla" else _gqa
  for layer in range(c.num_layers):
    rep, i = divmod(layer, len(c.attention_pattern))
    p = _take(params["layers"][f"layer_{i}"], rep)
    vis = masks[i]
    x = x + attn(p["attention"], _rms(x, p["attn_norm"]["scale"], c.norm_eps), positions, vis, c)
    h = _rms(x, p["mlp_norm"]["scale"], c.norm_eps)
    m = p["mlp"]
    x = x + (_silu(h @ m["wi_gate"]) * (h @ m["wi_up"])) @ m["wo"]
  x = _rms(x, params["final_norm"]["scale"], c.norm_eps)
  if return_hidden:
    return x
  w = params["embedding"].T if c.tie_embeddings else params["unembed"]["kernel"]
  return x @ w


def _silu(x):
  return x / (1 + jnp.exp(-x))


def _take(tree, index):
  return {k: _take(v, index) if isinstance(v, dict) else v[index] for k, v in tree.items()}
