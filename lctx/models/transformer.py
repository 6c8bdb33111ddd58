"""The decoder: embedding, scanned blocks of pre-norm layers, final norm, unembedding.

Layers are grouped into blocks of len(attention_pattern) layers (so each layer's
window size is a static Python value) and the block is scanned num_repeats times:
params live under `params['layers']['layer_{i}']` with a leading 'layers' axis of
size num_repeats. With scan_layers=False the same block is unrolled and its params
live under `params['layers_{r}']`; `stack_unscanned_params` converts.

Shapes legend (docs/contracts.md): B batch, T length, D d_model, E vocab.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lctx.models.attention import GQAAttention, MLAAttention, reference_attention_fn
from lctx.models.config import ModelConfig
from lctx.models.layers import MLP, constrain, norm_of, param
from lctx.models.linear_attention import GatedDeltaNet, KimiDeltaAttention

_ACT = ("act_batch", "act_seq", "act_embed")
LAYER_INPUT_NAME = "layer_input"
# The inputs of the layers inside a remat group (remat_group_inner_inputs): a name
# of their own, so the group's policy (which sees every name inside) leaves them.
GROUP_INNER_INPUT_NAME = "group_inner_input"


def tag_layer_input(x, pieces: int = 1, name: str = LAYER_INPUT_NAME):
  """x tagged `name` (LAYER_INPUT_NAME) for the remat policy, as `pieces` values split
  along d_model (ModelConfig.layer_input_pieces: keeps each saved or offloaded
  value under libtpu's 2**31-element limit; d_model is not sharded, so the
  split and the concatenation stay on each device)."""
  if pieces == 1:
    return checkpoint_name(x, name)
  parts = jnp.split(x, pieces, axis=-1)
  return jnp.concatenate([checkpoint_name(p, name) for p in parts], axis=-1)


class DecoderLayer(nn.Module):
  """x + attn(norm(x)), then + mlp(norm(.)); with post_sublayer_norms each
  sub-layer's output is normed too (Gemma). x `[B, T, D]` -> `[B, T, D]`."""

  config: ModelConfig
  mixer: Callable  # a SequenceMixer (lctx/parallel/mixer.py) or an attention function
  window_size: int | None = None
  # 'full_attention' | 'sliding_attention' | 'linear_attention' (ModelConfig.layer_types).
  layer_type: str = "full_attention"
  # The remat tag of the layer's input: None inside a remat group, where the
  # group tags its own input (GROUP_INNER_INPUT_NAME with remat_group_inner_inputs).
  input_tag: str | None = LAYER_INPUT_NAME

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    c = self.config
    x = constrain(x, _ACT)
    if self.input_tag:  # what 'offload_layer_inputs' and friends keep or offload
      x = tag_layer_input(x, c.layer_input_pieces, self.input_tag)
    mixer = self._token_mixer()
    if isinstance(mixer, GQAAttention):  # the norm inside its head stages, if any
      h = mixer(x, segment_ids, positions, pre=norm_of(c, "attn_norm")(x, as_function=True))
    else:
      h = mixer(norm_of(c, "attn_norm")(x), segment_ids, positions)
    if c.post_sublayer_norms:
      h = norm_of(c, "post_attn_norm")(h)
    x = constrain(x + h, _ACT)
    # The norms run inside the MLP's sequence chunks (one chunk's float32 norm
    # and its cotangent at a time; at Llama-8B with 524,288 tokens per device
    # the whole-sequence f32 value is 8 GiB).
    norm = norm_of(c, "mlp_norm")(x, as_function=True)
    post = norm_of(c, "post_mlp_norm")(x, as_function=True) if c.post_sublayer_norms else None
    return constrain(x + MLP(c, name="mlp")(x, pre=norm, post=post), _ACT)

  def _token_mixer(self) -> nn.Module:
    """The module that mixes tokens in this layer: attention (params under
    'attention') or a linear-attention layer (under 'linear_attention')."""
    c = self.config
    if self.layer_type == "linear_attention":
      cls = KimiDeltaAttention if c.linear_attention == "kda" else GatedDeltaNet
      return cls(c, self.mixer, name="linear_attention")
    attn_cls = MLAAttention if c.attention == "mla" else GQAAttention
    return attn_cls(c, self.mixer, self.window_size, name="attention")


class Block(nn.Module):
  """One period of the attention pattern: len(pattern) layers with static windows.

  in_group=True: the block runs inside a remat group (remat_group_size > 1); its
  layers are rematerialised with the policy of the tags other than the layer input
  and leave the input untagged (the group tags its own input), unless
  remat_group_inner_inputs='offload' sends their inputs to host too.
  """

  config: ModelConfig
  mixer: Callable
  in_group: bool = False

  @nn.compact
  def __call__(self, x, segment_ids, positions):
    c = self.config
    layer_cls = DecoderLayer
    if c.remat_policy != "none":
      # Per layer, so 'full' keeps one input per layer rather than per block.
      # prevent_cse is only needed outside scan (scan already blocks CSE; a
      # group scans its blocks too).
      outer, inner = checkpoint_policies(c)
      layer_cls = nn.remat(
        DecoderLayer, policy=inner if self.in_group else outer, prevent_cse=not c.scan_layers
      )
    for i, (window, kind) in enumerate(zip(c.attention_pattern, c.block_layer_types)):
      tag = LAYER_INPUT_NAME
      if self.in_group:
        tag = GROUP_INNER_INPUT_NAME if c.remat_group_inner_inputs == "offload" else None
      x = layer_cls(c, self.mixer, window, kind, input_tag=tag, name=f"layer_{i}")(
        x, segment_ids, positions
      )
    return x, None  # (carry, per-step output) for nn.scan


def remat_policy(name: str):
  """The jax.checkpoint policy of a named ModelConfig.remat_policy (None: no remat)."""
  if name == "custom":
    raise ValueError("remat_policy 'custom' needs its choices: use checkpoint_policies(config)")
  return checkpoint_policies(ModelConfig(remat_policy=name))[0]


def checkpoint_policies(c: ModelConfig):
  """(per-layer policy, policy of the layers inside a remat group) for a config.

  The first applies to each layer when remat_group_size == 1 and to the group as a
  whole otherwise, where only the group's input (tag layer_input) is visible to it;
  the second applies to the layers inside a group (every tag but layer_input).
  None means no remat.
  """
  cp = jax.checkpoint_policies
  if c.remat_policy == "none":
    return None, None
  if c.remat_policy in ("dots", "dots_no_batch"):
    dots = cp.dots_saveable if c.remat_policy == "dots" else cp.dots_with_no_batch_dims_saveable
    return (dots if c.remat_group_size == 1 else cp.nothing_saveable), dots
  choices = c.remat_choices
  if c.remat_group_size == 1:
    return _named_policy(choices), None
  group = {LAYER_INPUT_NAME: choices[LAYER_INPUT_NAME]}
  inner = {t: ch for t, ch in choices.items() if t != LAYER_INPUT_NAME}
  if c.remat_group_inner_inputs == "offload":
    inner[GROUP_INNER_INPUT_NAME] = "offload"
  return _named_policy(group), _named_policy(inner)


def _named_policy(choices: dict[str, str]):
  """jax.checkpoint policy keeping 'device' tags, offloading 'offload' tags to
  pinned host memory and recomputing everything else."""
  cp = jax.checkpoint_policies
  device = [t for t, ch in choices.items() if ch == "device"]
  offload = [t for t, ch in choices.items() if ch == "offload"]
  if not device and not offload:
    return cp.nothing_saveable
  if not offload:
    return cp.save_only_these_names(*device)
  return cp.save_and_offload_only_these_names(
    names_which_can_be_saved=device,
    names_which_can_be_offloaded=offload,
    offload_src="device",
    offload_dst="pinned_host",
  )


def _grouped_layers(c: ModelConfig, mixer, stacked, x, segment_ids, positions):
  """Runs the scanned blocks in remat groups of remat_group_size layers.

  stacked: the scanned layout `{'layer_{i}': ...}` with leading axis num_repeats.
  Each group of k layers is one jax.checkpoint whose only saved (or offloaded)
  value is its input; its layers are rematerialised again inside, so the
  backward holds at most k layer inputs of one group at a time.
  """
  blocks = c.remat_group_size // len(c.attention_pattern)  # blocks per group
  block = Block(c, mixer, in_group=True)
  outer, _ = checkpoint_policies(c)

  def group(x, params):  # params: leading axis `blocks`
    x = tag_layer_input(x, c.layer_input_pieces)
    # A scan, not a loop: its reverse pass recomputes one block at a time (an
    # unrolled loop lets XLA hoist every layer's recompute, so the temporaries
    # grow with the group; docs/benchmarks.md has the v5p measurement).
    if c.remat_group_inner_inputs == "offload" and len(c.attention_pattern) > 1:
      body = lambda x, p: (_block_by_runs(c, mixer, p, x, segment_ids, positions), None)  # noqa: E731
    else:
      body = lambda x, p: block.apply({"params": p}, x, segment_ids, positions)  # noqa: E731
    return jax.lax.scan(body, x, params)[0]

  group = jax.checkpoint(group, policy=outer, prevent_cse=False)  # in scan: no CSE
  grouped = jax.tree.map(lambda a: a.reshape((-1, blocks) + a.shape[1:]), stacked)
  x, _ = jax.lax.scan(lambda x, p: (group(x, p), None), x, grouped)
  return x


def _block_by_runs(c: ModelConfig, mixer, params, x, segment_ids, positions):
  """One block of several layers inside a remat group with
  remat_group_inner_inputs='offload': each run of consecutive layers of one kind
  (Qwen3.5's 3 Gated DeltaNet layers) is a scan over its layers' stacked params,
  each layer's input offloaded by the group's inner policy as in
  Block(in_group=True), which it replaces there.

  Why a scan: in an unrolled block's backward XLA copied every layer's input back
  from host at the top (nothing orders a copy after the later layers' backward),
  so they all waited on the device through the last layer's backward, the
  hybrids' peak (Qwen3.5-shaped at 720,896 tokens per device: four such copies,
  11 GiB). In a loop each copy back happens in its own iteration; XLA still
  starts the first one before the loop (docs/memory.md). An explicit host round
  trip per layer (a custom VJP whose copy back waits behind an optimization
  barrier on the output's cotangent) did not hold: the barrier was gone before
  scheduling and the copy came back at once. Same values and gradients as
  Block(in_group=True).
  """
  _, inner = checkpoint_policies(c)
  kinds = enumerate(zip(c.attention_pattern, c.block_layer_types))
  for (window, kind), run in itertools.groupby(kinds, key=lambda ik: ik[1]):
    run = [params[f"layer_{i}"] for i, _ in run]
    layer = DecoderLayer(c, mixer, window, kind, input_tag=GROUP_INNER_INPUT_NAME)

    def apply(x, p, layer=layer):
      return layer.apply({"params": p}, x, segment_ids, positions)

    apply = jax.checkpoint(apply, policy=inner, prevent_cse=False)  # in scan: no CSE
    if len(run) == 1:
      x = apply(x, run[0])
    else:
      stacked = jax.tree.map(lambda *a: jnp.stack(a), *run)
      x, _ = jax.lax.scan(lambda x, p: (apply(x, p), None), x, stacked)  # noqa: B023
  return x


def _init_stacked_blocks(c: ModelConfig, rng):
  """Params of num_repeats blocks in the scanned layout (what nn.scan creates),
  boxed with the 'layers' logical axis first. Shapes do not depend on the batch,
  the length or the attention plug-in, so a [1, 2, D] dummy and the reference
  attention suffice."""
  dummy = jnp.zeros((1, 2, c.d_model), c.dtype)
  ids = jnp.ones((1, 2), jnp.int32)
  block = Block(
    dataclasses.replace(c, remat_policy="none", remat_custom=(), remat_group_size=1),
    reference_attention_fn,
  )

  def one(key):
    with nn.logical_axis_rules(()):
      return block.init(key, dummy, ids, ids)["params"]

  boxed = jax.vmap(one)(jax.random.split(rng, c.num_repeats))
  return jax.tree.map(
    lambda b: b.add_axis(0, {nn.PARTITION_NAME: "layers"}),
    boxed,
    is_leaf=lambda v: isinstance(v, nn.meta.AxisMetadata),
  )


class Transformer(nn.Module):
  """Llama-family decoder; each layer mixes tokens through the given plug-in.

  mixer: the run's `SequenceMixer` (lctx.parallel.mixer; `ContextPlan.mixer`), or
  a bare attention function (such as `reference_attention_fn`), the mixer of
  every attention layer.
  """

  config: ModelConfig
  mixer: Callable = reference_attention_fn

  @nn.compact
  def __call__(self, inputs, positions, segment_ids, *, return_hidden: bool | str = False):
    """inputs, positions, segment_ids: int32 `[B, T]` (segment 0 = padding).

    Returns logits `[B, T, E]` float32, or with return_hidden=True the
    final-normed hidden `[B, T, D]` in the compute dtype (multiply by
    `unembed_matrix`), or with return_hidden='pre_norm' the pair (hidden before
    the final norm, the final norm as a pure per-token function): a chunked loss
    applies it chunk by chunk, so the norm's float32 values and cotangent never
    span the sequence.
    """
    if return_hidden not in (False, True, "pre_norm"):
      raise ValueError(f"return_hidden must be False, True or 'pre_norm'; got {return_hidden!r}")
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
    if c.embed_scale:  # the factor rounded to the compute dtype, as Gemma does
      x = x * jnp.asarray(c.d_model**0.5, c.dtype)

    if c.scan_layers and c.remat_group_size > 1:
      stacked = self.param("layers", lambda rng: _init_stacked_blocks(c, rng))
      x = _grouped_layers(c, self.mixer, stacked, x, segment_ids, positions)
    elif c.scan_layers:
      stack = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=c.num_repeats,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(c, self.mixer, name="layers")(x, segment_ids, positions)
    else:
      for r in range(c.num_repeats):
        x, _ = Block(c, self.mixer, name=f"layers_{r}")(x, segment_ids, positions)

    final_norm = norm_of(c, "final_norm")
    # Created even for return_hidden, so init with either output has every param.
    w = embedding.T if c.tie_embeddings else Unembed(c, name="unembed")()  # [D, E]
    if return_hidden == "pre_norm":
      return x, final_norm(x, as_function=True)
    x = final_norm(x)
    if return_hidden:
      return x
    logits = jnp.einsum("BTD,DE->BTE", x, w.astype(c.dtype)).astype(jnp.float32)
    if c.final_logit_softcap is not None:
      logits = c.final_logit_softcap * jnp.tanh(logits / c.final_logit_softcap)
    return constrain(logits, ("act_batch", "act_seq", "act_vocab"))


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
