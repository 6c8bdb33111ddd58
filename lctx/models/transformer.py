"""The decoder: embedding, scanned blocks of pre-norm layers, final norm, unembedding.

Layers are grouped into blocks of len(attention_pattern) layers (so each layer's
window size is a static Python value) and the block is scanned num_repeats times:
params live under `params['layers']['layer_{i}']` with a leading 'layers' axis of
size num_repeats. With scan_layers=False the same block is unrolled and its params
live under `params['layers_{r}']`; `stack_unscanned_params` converts.

Shapes legend: B batch, T length, D d_model, E vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lctx.models.attention import GQAAttention, MLAAttention, reference_attention_fn
from lctx.models.config import ModelConfig
from lctx.models.layers import MLP, RMSNorm, constrain, param

_ACT = ("act_batch", "act_seq", "act_embed")
LAYER_INPUT_NAME = "layer_input"


class DecoderLayer(nn.Module):
  """x + attn(norm(x)), then + mlp(norm(.)). x `[B, T, D]` -> `[B, T, D]`."""

  config: ModelConfig
  attention_fn: Callable
  window_size: int | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    c = self.config
    # Named so the 'offload_layer_inputs' remat policy can move it to host memory.
    x = checkpoint_name(constrain(x, _ACT), LAYER_INPUT_NAME)
    attn_cls = MLAAttention if c.attention == "mla" else GQAAttention
    h = RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name="attn_norm")(x)
    x = x + attn_cls(c, self.attention_fn, self.window_size, name="attention")(
      h, segment_ids, positions
    )
    x = constrain(x, _ACT)
    h = RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name="mlp_norm")(x)
    return constrain(x + MLP(c, name="mlp")(h), _ACT)


class Block(nn.Module):
  """One period of the attention pattern: len(pattern) layers with static windows."""

  config: ModelConfig
  attention_fn: Callable

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    c = self.config
    layer_cls = DecoderLayer
    if c.remat_policy != "none":
      # Per layer, so 'full' keeps one input per layer rather than per block.
      # prevent_cse is only needed outside scan (scan already blocks CSE).
      layer_cls = nn.remat(
        DecoderLayer, policy=remat_policy(c.remat_policy), prevent_cse=not c.scan_layers
      )
    for i, window in enumerate(c.attention_pattern):
      x = layer_cls(c, self.attention_fn, window, name=f"layer_{i}")(x, segment_ids, positions)
    return x, None  # (carry, per-step output) for nn.scan


def remat_policy(name: str):
  """The jax.checkpoint policy for a ModelConfig.remat_policy (None: no remat)."""
  cp = jax.checkpoint_policies
  if name == "none":
    return None
  if name == "full":
    return cp.nothing_saveable
  if name == "dots":
    return cp.dots_saveable
  if name == "dots_no_batch":
    return cp.dots_with_no_batch_dims_saveable
  if name == "offload_layer_inputs":
    return cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[],
      names_which_can_be_offloaded=[LAYER_INPUT_NAME],
      offload_src="device",
      offload_dst="pinned_host",
    )
  raise ValueError(f"unknown remat_policy {name!r}")


class Transformer(nn.Module):
  """Llama-family decoder; attention runs through the given plug-in."""

  config: ModelConfig
  attention_fn: Callable = reference_attention_fn

  @nn.compact
  def __call__(self, inputs, positions, segment_ids, *, return_hidden: bool = False):
    """inputs, positions, segment_ids: int32 `[B, T]` (segment 0 = padding).

    Returns logits `[B, T, E]` float32, or with return_hidden the final-normed
    hidden `[B, T, D]` in the compute dtype (multiply by `unembed_matrix`).
    """
    c = self.config
    embedding = param(
      self,
      "embedding",
      _embed_init(c),
      (c.vocab_size, c.d_model),
      ("vocab", "embed"),
      c.param_dtype,
    )
    x = constrain(jnp.take(embedding, inputs, axis=0).astype(c.dtype), _ACT)  # [B, T, D]

    if c.scan_layers:
      stack = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=c.num_repeats,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(c, self.attention_fn, name="layers")(x, segment_ids, positions)
    else:
      for r in range(c.num_repeats):
        x, _ = Block(c, self.attention_fn, name=f"layers_{r}")(x, segment_ids, positions)

    x = RMSNorm(c.norm_eps, c.dtype, c.param_dtype, name="final_norm")(x)
    # Created even for return_hidden, so init with either output has every param.
    w = embedding.T if c.tie_embeddings else Unembed(c, name="unembed")()  # [D, E]
    if return_hidden:
      return x
    logits = jnp.einsum("BTD,DE->BTE", x, w.astype(c.dtype))
    return constrain(logits.astype(jnp.float32), ("act_batch", "act_seq", "act_vocab"))


class Unembed(nn.Module):
  """Owns the `[D, E]` unembedding at params['unembed']['kernel']."""

  config: ModelConfig

  @nn.compact
  def __call__(self):
    c = self.config
    return param(
      self,
      "kernel",
      nn.initializers.lecun_normal(),
      (c.d_model, c.vocab_size),
      ("embed", "vocab"),
      c.param_dtype,
    )


def _embed_init(c: ModelConfig):
  # Untied: unit-variance rows (the first RMSNorm rescales anyway). Tied: the same
  # table is the unembedding, so rows of norm ~1 keep initial logits O(1).
  return nn.initializers.normal(c.d_model**-0.5 if c.tie_embeddings else 1.0)


def unembed_matrix(params: Any, config: ModelConfig) -> jax.Array:
  """The `[D, E]` unembedding from a (possibly boxed) params tree: the transposed
  embedding when tied. Accepts `params` with or without the outer 'params' key."""
  params = nn.unbox(params)
  params = params.get("params", params)
  if config.tie_embeddings:
    return params["embedding"].T
  return params["unembed"]["kernel"]


def stack_unscanned_params(params: Any, config: ModelConfig) -> Any:
  """Converts scan_layers=False params ('layers_{r}') to the scanned layout."""
  params = dict(nn.unbox(params))
  repeats = [params.pop(f"layers_{r}") for r in range(config.num_repeats)]
  params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *repeats)
  return params
