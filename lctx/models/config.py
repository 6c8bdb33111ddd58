"""Model configuration: one frozen dataclass, its validation, and FLOP/param counts.

Shapes legend (docs/contracts.md): B batch, T length, N q heads, K kv heads,
H head dim (q/k), V value head dim, D d_model, F MLP hidden, E vocab.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from lctx.models import rope
from lctx.parallel.mixer import LAYER_TYPES

ATTENTION_KINDS = ("mha_gqa", "mla")
LINEAR_KINDS = ("gated_deltanet", "kda")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# Named activations (jax.ad_checkpoint.checkpoint_name) a remat policy can keep on
# the device, offload to pinned host memory or recompute. Shapes per layer:
#   layer_input [B, T, D] (one per layer, or per group with remat_group_size > 1);
#   query_proj [B, T, N, H], key_proj [B, T, K, H], value_proj [B, T, K, V] (after
#   RoPE, what attention consumes); attention_out [B, T, N, V] (attention's output
#   before the output projection); out_proj [B, T, D]; mlp_gate, mlp_up, mlp_hidden
#   [B*T, F] (mlp_hidden = silu(gate) * up); mlp_out [B*T, D].
# attention_lse [B, N, T] f32: the kernel's logsumexp. The attention kernels' custom
# VJPs tag their own residuals, output and lse (lctx/kernels/remat_tags.py), so a
# policy keeping both never re-runs the attention forward in the backward; the
# model tags the output itself only for plug-ins that do not.
REMAT_TAGS = (
  "layer_input",
  "query_proj",
  "key_proj",
  "value_proj",
  "attention_out",
  "attention_lse",
  "out_proj",
  "mlp_gate",
  "mlp_up",
  "mlp_hidden",
  "mlp_out",
)
REMAT_CHOICES = ("device", "offload", "remat")
_QKV = ("query_proj", "key_proj", "value_proj")
# The tags that are matmul outputs: what the JAX dot policies (`dots`,
# `dots_no_batch`) save.
DOT_TAGS = _QKV + ("out_proj", "mlp_gate", "mlp_up", "mlp_out")
# What the attention backward needs from its forward: the output and its lse.
ATTENTION_RESIDUALS = ("attention_out", "attention_lse")
# Presets expressed as per-tag choices; a tag not listed is recomputed ('remat').
# The layer input is always kept on the device unless a choice says otherwise
# (it is what a rematerialised layer restarts from).
REMAT_PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
  "full": (),
  "minimal": tuple((t, "device") for t in DOT_TAGS),
  "minimal_offloaded": tuple((t, "offload") for t in DOT_TAGS),
  "save_dots": tuple((t, "device") for t in DOT_TAGS + ATTENTION_RESIDUALS + ("mlp_hidden",)),
  "save_qkv_proj": tuple((t, "device") for t in _QKV),
  "qkv_proj_offloaded": tuple((t, "offload") for t in _QKV),
  "save_attention_out": tuple((t, "device") for t in ATTENTION_RESIDUALS),
  "attention_out_offloaded": tuple((t, "offload") for t in ATTENTION_RESIDUALS),
  "offload_layer_inputs": (("layer_input", "offload"),),
  "offload_layer_inputs_and_attention_out": (
    ("layer_input", "offload"),
    *((t, "offload") for t in ATTENTION_RESIDUALS),
  ),
}
# Policies that are not per-tag choices: no remat at all, and JAX's dot policies.
REMAT_POLICIES = ("none", "dots", "dots_no_batch", *REMAT_PRESETS, "custom")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (optionally MLA attention, sliding-window patterns)."""

  vocab_size: int = 256
  """E: number of token ids."""
  d_model: int = 64
  """D: width of the residual stream."""
  num_layers: int = 2
  """Decoder layers; a multiple of len(attention_pattern)."""
  num_heads: int = 4
  """N: query heads (and, for MLA, the key/value heads too)."""
  num_kv_heads: int = 4
  """K: key/value heads for mha_gqa (N = MHA, 1 = MQA, else GQA). N % K == 0."""
  head_dim: int = 16
  """H: per-head q/k/v width for mha_gqa (unused by MLA, which has its own dims)."""
  mlp_dim: int = 128
  """F: SwiGLU hidden width."""
  rope_theta: float = 10000.0
  """RoPE base; Llama-3 uses 500000."""
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  """RoPE frequency schedule as Hugging Face's `rope_scaling` dict (config.json), kept
    as sorted (key, value) pairs; gin may bind a dict. Empty = the default schedule.
    rope_type 'linear' (factor), 'llama3' (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings: Llama 3.1) or 'yarn' (factor,
    original_max_position_embeddings, optional beta_fast, beta_slow, attention_factor,
    mscale, mscale_all_dim, truncate); see lctx.models.rope."""
  qkv_bias: bool = False
  """Biases on the q/k/v projections (Qwen2): params bq [N, H], bk [K, H], bv [K, H]."""
  qk_norm: bool = False
  """RMSNorm over the head dim on q and k before RoPE (Qwen3): params q_norm/scale [H]
    and k_norm/scale [H]."""
  norm_eps: float = 1e-5
  """RMSNorm epsilon."""
  attention: str = "mha_gqa"
  """'mha_gqa' (MHA/GQA/MQA by num_kv_heads) or 'mla' (DeepSeek-V2 latent KV)."""
  q_lora_rank: int = 0
  """MLA: rank of the query compression; 0 = full-rank query projection."""
  kv_lora_rank: int = 32
  """MLA: width of the compressed KV latent (what an inference cache would hold)."""
  qk_nope_head_dim: int = 16
  """MLA: per-head q/k part without rotary embedding."""
  qk_rope_head_dim: int = 8
  """MLA: per-head q/k rotary part; the key's rope part is shared by all heads. Even."""
  v_head_dim: int = 16
  """MLA: V, per-head value width."""
  attention_pattern: tuple[int | None, ...] = (None,)
  """Window size per layer, cycled over the layers (None = global). E.g.
    (1024,) * 5 + (None,) is Gemma's five local layers to one global. With
    layer_types set, it is derived from them (one period of the pattern)."""
  layer_types: tuple[str, ...] = ()
  """What each layer mixes tokens with, one entry per layer, in Hugging Face's
    names (LAYER_TYPES: 'full_attention', 'sliding_attention' with
    `sliding_window`, 'linear_attention'). () : every layer is an attention layer
    with the window attention_pattern gives it. The scanned block is the
    shortest period of the list that divides num_layers (the whole stack when
    none does)."""
  sliding_window: int | None = None
  """Window of the 'sliding_attention' layers of layer_types (keys within w
    positions of the query, itself included)."""
  dtype: str = "float32"
  """Compute dtype of activations and matmuls ('bfloat16' for training)."""
  param_dtype: str = "float32"
  """Storage dtype of parameters (master weights)."""
  remat_policy: str = "none"
  """Rematerialisation of each layer (REMAT_POLICIES): 'none' (save everything),
    'dots' / 'dots_no_batch' (jax.checkpoint_policies.dots_saveable /
    dots_with_no_batch_dims_saveable), a preset of per-tag choices
    (REMAT_PRESETS: 'full' recomputes everything from the layer input, 'minimal'
    keeps the weight matmuls' outputs, 'save_dots' also the attention output and
    MLP hidden, 'save_qkv_proj' / 'qkv_proj_offloaded', 'save_attention_out' /
    'attention_out_offloaded', 'offload_layer_inputs' keeps each layer's input in
    pinned host memory, ...), or 'custom' (remat_custom)."""
  remat_custom: tuple[tuple[str, str], ...] = ()
  """With remat_policy='custom': (tag, choice) pairs, tag in REMAT_TAGS, choice
    'device' (keep), 'offload' (pinned host memory) or 'remat' (recompute, the
    default for unlisted tags). Gin: `ModelConfig.remat_custom = (('layer_input',
    'offload'), ('query_proj', 'device'))`."""
  remat_group_size: int = 1
  """Layers per rematerialised group: k > 1 saves (or offloads) one layer input
    per k layers and recomputes the group's layers from it in the backward (each
    layer again rematerialised inside, so at most k inputs live at once). A
    multiple of len(attention_pattern) that divides num_layers; needs a remat
    policy other than 'none' and scan_layers=True."""
  remat_group_inner_inputs: str = "device"
  """With remat_group_size > 1: where a group keeps the inputs of its layers while
    its backward recomputes them ('device': k of them on the device at once;
    'offload': each goes to pinned host memory as it is recomputed and comes back
    for its layer's backward, like the group's own input under an offloading
    policy; a block of several layers scans each run of same-kind layers, so each
    copy back happens in its own iteration). Host memory grows by one group's k
    inputs, the device's by none.
    Layers outside groups (remat_group_size 1) have no inner inputs: no effect."""
  layer_input_pieces: int = 1
  """Save (or offload) each layer input as this many pieces split along d_model
    (a divisor of d_model). libtpu 0.0.42.1 aborts the compile
    (llo_loop.cc:165) when the layer scan offloads one value of 2**31 or more
    elements per device: Llama-8B (d_model 4096) at 524,288 tokens per device,
    i.e. 32M tokens on 64 devices. The trainer refuses such a setup with a
    message naming this setting."""
  scan_layers: bool = True
  """Scan over layers (one compiled block). False unrolls them (debugging)."""
  mlp_chunk_size: int | None = None
  """Run the MLP over sequence chunks of this many tokens (lctx.kernels.chunked_mlp)
    so its [B, T, F] hidden never lives whole. None = one piece."""
  tie_embeddings: bool = False
  """Use the input embedding's transpose as the unembedding."""
  # ---- hybrid families (Qwen3.5 / Qwen3-Next / Kimi Linear): linear layers and
  # the full-attention variants they pair with (lctx.models.linear_attention) ----
  linear_attention: str = "gated_deltanet"
  """What the 'linear_attention' layers of layer_types run (LINEAR_KINDS):
    'gated_deltanet' (Qwen3.5 / Qwen3-Next: scalar decay per head) or 'kda'
    (Kimi Delta Attention: per-channel decay, low-rank gate projections)."""
  linear_num_key_heads: int = 4
  """Linear layers: q/k heads (Hq). KDA: equal to linear_num_value_heads."""
  linear_num_value_heads: int = 4
  """Linear layers: value heads (Hv), a multiple of linear_num_key_heads; value
    head j reads q/k head j // (Hv / Hq), as transformers' repeat_interleave."""
  linear_key_head_dim: int = 16
  """Linear layers: q/k head width (the state's rows)."""
  linear_value_head_dim: int = 16
  """Linear layers: value head width (the state's columns)."""
  linear_conv_kernel_dim: int = 4
  """Linear layers: width W of the causal depthwise conv over q, k and v."""
  linear_chunk_size: int | None = None
  """Run each linear layer whole (projections, conv, delta rule, gated norm,
    output projection) over sequence chunks of this many tokens, the state and
    the conv's W-1 tokens carried from chunk to chunk, so no per-token value but
    the layer's input and output spans the sequence (lctx.parallel.linear_context
    `chunked_layer`; the backward recomputes one chunk at a time). It must divide
    each piece (the tokens per device, halved under zigzag); larger: one chunk
    per piece. Heads are not split over `tensor` inside it (each tensor device
    computes every head). None = whole, the remat tags inside the layer apply."""
  attention_output_gate: bool = False
  """Full attention scales its output per channel by sigmoid(x Wg) before the
    output projection (Qwen3.5 / Qwen3-Next: q_proj also produces the gate);
    param wg [D, N, H]."""
  partial_rotary_factor: float = 1.0
  """mha_gqa: RoPE rotates the first int(H x factor) dims of each q/k head and
    passes the rest (Qwen3.5: 0.25), as transformers' apply_rotary_pos_emb."""
  mla_rope: bool = True
  """MLA: rotate the rope dims of q and the shared key. False: no RoPE at all,
    the dims stay as projected (Kimi Linear's MLA layers)."""
  # ---- Gemma-family options (h-gemma); the defaults are the Llama family ----
  norm_plus_one: bool = False
  """Every RMSNorm multiplies by (1 + scale), scale initialised to 0 (Gemma's
    zero-centred norms, q/k norms included)."""
  mlp_activation: str = "silu"
  """The gated MLP's activation (MLP_ACTIVATIONS): 'silu' (SwiGLU) or 'gelu_tanh'
    (GeGLU with the tanh GELU: transformers' gelu_pytorch_tanh, Gemma)."""
  embed_scale: bool = False
  """Multiply the embedding by sqrt(d_model), the factor rounded to the compute
    dtype first (Gemma: sqrt(3072) is 55.5 in bfloat16)."""
  post_sublayer_norms: bool = False
  """Norms after each sub-layer too: x + norm(attn(norm(x))), then
    + norm(mlp(norm(.))) (Gemma 2/3's post-attention and post-feedforward norms):
    params post_attn_norm/scale and post_mlp_norm/scale [D]."""
  query_pre_attn_scalar: float | None = None
  """Attention logits scale by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5
    (Gemma). None: head_dim^-0.5 (MLA: its own)."""
  sliding_rope_theta: float | None = None
  """RoPE base of the sliding-window layers (with sliding_rope_scaling); None:
    rope_theta and rope_scaling apply to every layer. Gemma 3: 10,000 local and
    1,000,000 with linear scaling global."""
  sliding_rope_scaling: tuple[tuple[str, Any], ...] = ()
  """rope_scaling of the sliding-window layers (needs sliding_rope_theta); empty:
    the default schedule."""
  final_logit_softcap: float | None = None
  """logits = cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping); None: off."""

  def __post_init__(self):
    # Gin may hand lists for remat_custom; keep the config hashable.
    custom = self.remat_custom
    if isinstance(custom, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in custom):
      object.__setattr__(self, "remat_custom", tuple(tuple(p) for p in custom))
    object.__setattr__(self, "rope_scaling", rope.scaling_pairs(self.rope_scaling))
    scaling = rope.scaling_pairs(self.sliding_rope_scaling)
    object.__setattr__(self, "sliding_rope_scaling", scaling)
    if self.layer_types:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
      object.__setattr__(self, "attention_pattern", _pattern_of_layer_types(self))
    validate(self)

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    """rope_scaling as a dict (None for the default schedule)."""
    return dict(self.rope_scaling) if self.rope_scaling else None

  @property
  def remat_choices(self) -> dict[str, str] | None:
    """Tag -> 'device' | 'offload' | 'remat' for every REMAT_TAGS entry, or None
    when the policy is not per-tag ('none', 'dots', 'dots_no_batch')."""
    if self.remat_policy == "custom":
      pairs = self.remat_custom
    elif self.remat_policy in REMAT_PRESETS:
      pairs = REMAT_PRESETS[self.remat_policy]
    else:
      return None
    choices = dict.fromkeys(REMAT_TAGS, "remat")
    choices.update(dict(pairs))
    return choices

  @property
  def num_repeats(self) -> int:
    """Scan length: how many times the attention_pattern block repeats."""
    return self.num_layers // len(self.attention_pattern)

  @property
  def attention_head_dims(self) -> tuple[int, int, int, int]:
    """(N, K, H, V) as the attention kernels see them: MLA hands them K = N heads
    of H = nope + rope q/k dims and its own V; MHA/GQA/MQA have V = H."""
    if self.attention == "mla":
      qk = self.qk_nope_head_dim + self.qk_rope_head_dim
      return self.num_heads, self.num_heads, qk, self.v_head_dim
    return self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim

  def rope_of(self, window_size: int | None) -> tuple[float, dict[str, Any] | None]:
    """(theta, rope_scaling dict or None) of a layer with this window (None: a
    full-attention layer)."""
    if window_size is not None and self.sliding_rope_theta is not None:
      return self.sliding_rope_theta, dict(self.sliding_rope_scaling) or None
    return self.rope_theta, self.rope_scaling_dict

  def window_of_layer(self, layer: int) -> int | None:
    return self.attention_pattern[layer % len(self.attention_pattern)]

  @property
  def block_layer_types(self) -> tuple[str, ...]:
    """The layer type of each layer of the scanned block (one period)."""
    if self.layer_types:
      return self.layer_types[: len(self.attention_pattern)]
    return tuple(
      "full_attention" if w is None else "sliding_attention" for w in self.attention_pattern
    )

  def layer_type_of(self, layer: int) -> str:
    """'full_attention' | 'sliding_attention' | 'linear_attention' of one layer."""
    types = self.block_layer_types
    return types[layer % len(types)]

  @property
  def layer_windows(self) -> tuple[int | None, ...]:
    """Attention window of every layer in order (None = global)."""
    return tuple(self.window_of_layer(i) for i in range(self.num_layers))

  def num_params(self, include_embedding: bool = True) -> int:
    """Parameter count. include_embedding=False drops the input embedding table
    (an untied unembedding is always counted: it is a matmul)."""
    d, e = self.d_model, self.vocab_size
    per_layer = 2 * d + 3 * d * self.mlp_dim + _attention_matmul_params(self)
    per_layer += _attention_norm_params(self)
    per_layer += 2 * d if self.post_sublayer_norms else 0
    total = self.num_layers * per_layer + d  # + final norm
    linear = sum(t == "linear_attention" for t in self.layer_types)  # their own mixers
    total += linear * (linear_layer_params(self) - per_layer + 2 * d + 3 * d * self.mlp_dim)
    if include_embedding:
      total += e * d
    if not self.tie_embeddings or not include_embedding:
      total += d * e
    return total

  def flops_per_token(self, seq_len: int, causal: bool = True, training: bool = True) -> float:
    """Model FLOPs per token (the PaLM-paper MFU convention), packing-independent.

    Forward per token and layer: 2 x (projection matmul params) + attention
    2 x keys x N x (H_qk + V) (= 4 x keys x N x H when H_qk = V); plus 2 D E
    for the unembedding. keys is the mean number of visible keys per query:
    seq (non-causal global), seq/2 (causal global), w - w^2/(2 seq) for a
    causal window w < seq (the exact mean of min(p, w) over p in [0, seq),
    continuous with seq/2 at w = seq), min(2w - 1, seq) non-causal windowed.
    training=True returns 3x forward (forward + backward), the MFU numerator.
    """
    n = self.num_heads
    if self.attention == "mla":
      qk_dim, v_dim = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
    else:
      qk_dim = v_dim = self.head_dim
    proj = 2 * (_attention_matmul_params(self) + 3 * self.d_model * self.mlp_dim)
    total = 0.0
    for layer in range(self.num_layers):
      if self.layer_type_of(layer) == "linear_attention":
        total += 2 * 3 * self.d_model * self.mlp_dim + linear_layer_flops(self, seq_len)
        continue
      keys = _mean_visible_keys(seq_len, self.window_of_layer(layer), causal)
      total += proj + 2 * keys * n * (qk_dim + v_dim)
    total += 2 * self.d_model * self.vocab_size
    return 3 * total if training else total


def _mean_visible_keys(seq: int, window: int | None, causal: bool) -> float:
  if window is None or window >= seq:
    return seq / 2 if causal else float(seq)
  if causal:
    return window - window * window / (2 * seq)
  return float(min(2 * window - 1, seq))


def _attention_matmul_params(c: ModelConfig) -> int:
  """Weights of the attention projections of one layer (no norms)."""
  d, n = c.d_model, c.num_heads
  if c.attention == "mla":
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = d * c.q_lora_rank + c.q_lora_rank * n * qk if c.q_lora_rank else d * n * qk
    kv = d * (c.kv_lora_rank + c.qk_rope_head_dim)
    kv += c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + n * c.v_head_dim * d
  h = c.head_dim
  gate = d * n * h if c.attention_output_gate else 0
  return d * (n + 2 * c.num_kv_heads) * h + n * h * d + gate


def _attention_norm_params(c: ModelConfig) -> int:
  """Norm scales and biases of one layer's attention."""
  if c.attention == "mla":
    return c.q_lora_rank + c.kv_lora_rank
  h = c.head_dim
  bias = (c.num_heads + 2 * c.num_kv_heads) * h if c.qkv_bias else 0
  return bias + (2 * h if c.qk_norm else 0)


def _validate_layer_input_pieces(c: ModelConfig) -> None:
  k = c.layer_input_pieces
  if not isinstance(k, int) or k < 1 or c.d_model % k:
    raise ValueError(
      f"layer_input_pieces must be a positive divisor of d_model ({c.d_model}); got {k!r}"
    )


def _validate_remat_custom(c: ModelConfig) -> None:
  custom = c.remat_custom
  if c.remat_policy != "custom":
    if custom:
      raise ValueError(
        f"remat_custom is set ({custom!r}) but remat_policy is {c.remat_policy!r}; "
        "set remat_policy='custom' to use per-tag choices"
      )
    return
  if not isinstance(custom, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in custom):
    raise ValueError(
      "remat_custom must be (tag, choice) pairs, e.g. (('layer_input', 'offload'),); "
      f"got {custom!r}"
    )
  seen = set()
  for tag, choice in custom:
    if tag not in REMAT_TAGS:
      raise ValueError(f"remat_custom: unknown tag {tag!r}; tags are {REMAT_TAGS}")
    if choice not in REMAT_CHOICES:
      raise ValueError(f"remat_custom: choice {choice!r} for {tag!r} is not one of {REMAT_CHOICES}")
    if tag in seen:
      raise ValueError(f"remat_custom: tag {tag!r} is given more than once")
    seen.add(tag)


def _validate_remat_group(c: ModelConfig) -> None:
  if c.remat_group_inner_inputs not in ("device", "offload"):
    raise ValueError(
      f"remat_group_inner_inputs must be 'device' or 'offload'; got {c.remat_group_inner_inputs!r}"
    )
  if (
    c.remat_group_inner_inputs == "offload"
    and c.remat_group_size > 1
    and (c.remat_policy in ("none", "dots", "dots_no_batch"))
  ):
    raise ValueError(
      "remat_group_inner_inputs='offload' needs a per-tag remat policy (a preset or "
      f"'custom'); remat_policy={c.remat_policy!r} has no tags to offload by"
    )
  k, period = c.remat_group_size, len(c.attention_pattern) if c.attention_pattern else 1
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"remat_group_size must be an int >= 1; got {k!r}")
  if k == 1:
    return
  if c.remat_policy == "none":
    raise ValueError(
      f"remat_group_size={k} needs a remat policy; remat_policy='none' saves everything"
    )
  if not c.scan_layers:
    raise ValueError(f"remat_group_size={k} needs scan_layers=True")
  if k % period or c.num_layers % k:
    raise ValueError(
      f"remat_group_size ({k}) must be a multiple of len(attention_pattern) ({period}) "
      f"and divide num_layers ({c.num_layers})"
    )


def validate(c: ModelConfig) -> None:
  """Raises one ValueError naming the broken rule and the numbers."""
  for name in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim"):
    if getattr(c, name) < 1:
      raise ValueError(f"{name} must be >= 1; got {getattr(c, name)}")
  if c.attention not in ATTENTION_KINDS:
    raise ValueError(f"attention must be one of {ATTENTION_KINDS}; got {c.attention!r}")
  if c.remat_policy not in REMAT_POLICIES:
    raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}; got {c.remat_policy!r}")
  _validate_remat_custom(c)
  _validate_remat_group(c)
  _validate_layer_input_pieces(c)
  rope.validate_scaling(c.rope_scaling_dict)
  _validate_gemma_options(c)
  if c.attention == "mla" and (c.qkv_bias or c.qk_norm):
    raise ValueError("qkv_bias and qk_norm apply to mha_gqa attention; MLA has its own norms")
  for name in ("dtype", "param_dtype"):
    if getattr(c, name) not in DTYPES:
      raise ValueError(f"{name} must be one of {DTYPES}; got {getattr(c, name)!r}")
  if c.sliding_window is not None and (
    not isinstance(c.sliding_window, int) or c.sliding_window < 1
  ):
    raise ValueError(f"sliding_window must be None or an int >= 1; got {c.sliding_window!r}")
  pattern = c.attention_pattern
  if not isinstance(pattern, tuple) or not pattern:
    raise ValueError(f"attention_pattern must be a non-empty tuple; got {pattern!r}")
  for w in pattern:
    if w is not None and (not isinstance(w, int) or w < 1):
      raise ValueError(f"attention_pattern entries must be None or ints >= 1; got {pattern}")
  if c.num_layers % len(pattern):
    raise ValueError(
      f"num_layers ({c.num_layers}) must be a multiple of len(attention_pattern) "
      f"({len(pattern)}) so the scanned block of {len(pattern)} layers repeats evenly"
    )
  _validate_hybrid(c)
  if c.mlp_chunk_size is not None and c.mlp_chunk_size < 1:
    raise ValueError(f"mlp_chunk_size must be None or >= 1; got {c.mlp_chunk_size}")
  if c.attention == "mha_gqa":
    if c.num_kv_heads < 1 or c.num_heads % c.num_kv_heads:
      raise ValueError(
        f"num_heads ({c.num_heads}) must be a multiple of num_kv_heads "
        f"({c.num_kv_heads}) for GQA/MQA grouping"
      )
    if c.head_dim < 2 or c.head_dim % 2:
      raise ValueError(f"head_dim must be even (RoPE rotates pairs); got {c.head_dim}")
  else:
    if c.kv_lora_rank < 1 or c.qk_nope_head_dim < 0 or c.v_head_dim < 1:
      raise ValueError(
        f"MLA needs kv_lora_rank >= 1, qk_nope_head_dim >= 0, v_head_dim >= 1; got "
        f"{c.kv_lora_rank}, {c.qk_nope_head_dim}, {c.v_head_dim}"
      )
    if c.qk_rope_head_dim < 2 or c.qk_rope_head_dim % 2:
      raise ValueError(
        f"MLA qk_rope_head_dim must be even and >= 2 (RoPE rotates pairs); got {c.qk_rope_head_dim}"
      )
    if c.q_lora_rank < 0:
      raise ValueError(f"q_lora_rank must be >= 0 (0 = no compression); got {c.q_lora_rank}")


# ----------------------------------------------------------------------------
# The parameter tree: which fields fix it
# ----------------------------------------------------------------------------
SHAPE_FIELDS = (
  "vocab_size",
  "d_model",
  "num_layers",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "mlp_dim",
  "attention",
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "tie_embeddings",
  "qkv_bias",
  "qk_norm",
  # hybrid families: which layers are linear, and their shapes
  "layer_types",
  "linear_attention",
  "linear_num_key_heads",
  "linear_num_value_heads",
  "linear_key_head_dim",
  "linear_value_head_dim",
  "linear_conv_kernel_dim",
  "attention_output_gate",
  "post_sublayer_norms",
)
"""Fields that fix the parameters' names and shapes (a pretrained checkpoint's
config.json sets them). Every other field (RoPE, dtypes, remat, chunking, windows)
can change between runs that share parameters."""


def param_layout(fields: Mapping[str, Any]) -> dict[str, Any]:
  """The settings that fix the stored parameter tree: names, shapes and dtypes.

  fields: a ModelConfig's `dataclasses.asdict` (as a checkpoint's meta holds it,
  JSON lists for tuples); a missing field has its default (configs saved before
  the field existed). Besides SHAPE_FIELDS: `param_dtype`, `scan_layers` (scanned
  or unrolled layout) and `attention_pattern` by its length (the layers of one
  scanned block: their window sizes do not change the tree).
  """
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}

  def get(name):
    return fields.get(name, defaults[name])

  layout = {name: get(name) for name in (*SHAPE_FIELDS, "param_dtype", "scan_layers")}
  layout["attention_pattern (its length)"] = len(get("attention_pattern"))
  # Which layers are linear fixes the tree; sliding vs full attention does not.
  layout["layer_types"] = [t == "linear_attention" for t in layout["layer_types"]]
  return layout


def _pattern_of_layer_types(c: ModelConfig) -> tuple[int | None, ...]:
  """attention_pattern (one period of windows) for a config with layer_types;
  raises a ValueError naming the field for a list that cannot be built."""
  types = c.layer_types
  bad = sorted({t for t in types if t not in LAYER_TYPES})
  if bad:
    raise ValueError(f"layer_types entries must be in {LAYER_TYPES}; got {bad}")
  if len(types) != c.num_layers:
    raise ValueError(
      f"layer_types has {len(types)} entries; it needs one per layer (num_layers={c.num_layers})"
    )
  if "sliding_attention" in types and c.sliding_window is None:
    raise ValueError("layer_types has 'sliding_attention' layers: set sliding_window")
  period = next(
    p
    for p in range(1, len(types) + 1)
    if len(types) % p == 0 and types == types[:p] * (len(types) // p)
  )
  derived = tuple(c.sliding_window if t == "sliding_attention" else None for t in types[:period])
  if c.attention_pattern not in ((None,), derived):
    raise ValueError(
      f"set layer_types or attention_pattern, not both: attention_pattern={c.attention_pattern} "
      f"disagrees with layer_types (whose windows are {derived})"
    )
  return derived


# ----------------------------------------------------------------------------
# Hybrid families: linear layers and their full-attention variants
# ----------------------------------------------------------------------------
def has_linear_layers(c: ModelConfig) -> bool:
  return "linear_attention" in c.layer_types


def _validate_hybrid(c: ModelConfig) -> None:
  """The linear-attention fields and the full-attention variants of the hybrids."""
  if c.linear_attention not in LINEAR_KINDS:
    raise ValueError(f"linear_attention must be one of {LINEAR_KINDS}; got {c.linear_attention!r}")
  names = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
  )
  for name in names:
    if not isinstance(getattr(c, name), int) or getattr(c, name) < 1:
      raise ValueError(f"{name} must be an int >= 1; got {getattr(c, name)!r}")
  if c.linear_chunk_size is not None and (
    not isinstance(c.linear_chunk_size, int) or c.linear_chunk_size < 1
  ):
    raise ValueError(f"linear_chunk_size must be None or an int >= 1; got {c.linear_chunk_size!r}")
  hq, hv = c.linear_num_key_heads, c.linear_num_value_heads
  if hv % hq:
    raise ValueError(
      f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hq}): "
      "each q/k head serves Hv / Hq consecutive value heads"
    )
  if c.linear_attention == "kda" and hq != hv:
    raise ValueError(
      f"linear_attention='kda' has one head count: linear_num_key_heads ({hq}) must equal "
      f"linear_num_value_heads ({hv})"
    )
  if c.attention_output_gate and c.attention != "mha_gqa":
    raise ValueError("attention_output_gate applies to mha_gqa attention (Qwen3.5 / Qwen3-Next)")
  f = c.partial_rotary_factor
  if not 0 < f <= 1:
    raise ValueError(f"partial_rotary_factor must be in (0, 1]; got {f}")
  rotary = rotary_dim(c)
  if f != 1 and c.attention == "mha_gqa" and (rotary < 2 or rotary % 2):
    raise ValueError(
      f"partial_rotary_factor={f} rotates int(head_dim x factor) = {rotary} dims of "
      f"head_dim {c.head_dim}: it must be even and >= 2 (RoPE rotates pairs)"
    )
  if f != 1 and c.attention != "mha_gqa":
    raise ValueError("partial_rotary_factor applies to mha_gqa attention (MLA has its rope dims)")


def rotary_dim(c: ModelConfig) -> int:
  """The q/k dims RoPE rotates in an mha_gqa head (the first ones)."""
  return int(c.head_dim * c.partial_rotary_factor)


def linear_layer_params(c: ModelConfig) -> int:
  """Weights of one linear-attention layer's token mixer (no layer norms)."""
  d, w = c.d_model, c.linear_conv_kernel_dim
  hq, hv, k, v = (
    c.linear_num_key_heads,
    c.linear_num_value_heads,
    c.linear_key_head_dim,
    c.linear_value_head_dim,
  )
  qk, vv = hq * k, hv * v
  conv = w * (2 * qk + vv)
  if c.linear_attention == "kda":
    # q, k, v, out; beta; forget gate (low rank K) + dt_bias + A_log; output gate (rank K); norm
    return (
      d * (2 * qk + vv) + vv * d + d * hv + (d * k + k * qk + qk + hv) + (d * k + k * vv) + v + conv
    )
  # q, k, v, z, out; b, a; dt_bias, A_log; gated norm
  return d * (2 * qk + 2 * vv) + vv * d + 2 * d * hv + 2 * hv + v + conv


LINEAR_CHUNK = 64  # lctx.kernels.delta_rule's default chunk (tokens)


SOLVE_BLOCK = 16  # lctx.kernels.delta_rule._SOLVE_BLOCK


def _lower_inverse_flops(c: int) -> float:
  """Matmul FLOPs of lctx.kernels.delta_rule._unit_lower_inverse on one C x C
  block: up to SOLVE_BLOCK rows (ceil(log2 C) - 1) rounds of 2 C^3 (the squaring)
  + 2 C^3 (the product); above, both halves' and the off-diagonal block's
  2 (C-h) h^2 + 2 (C-h)^2 h."""
  if c <= SOLVE_BLOCK:
    return max(0, math.ceil(math.log2(c)) - 1) * 4 * c**3 if c > 1 else 0
  h = c // 2
  return _lower_inverse_flops(h) + _lower_inverse_flops(c - h) + 2 * (c - h) * h * c


def unit_lower_solve_flops(c: int, width: int) -> float:
  """Matmul FLOPs of lctx.kernels.delta_rule._unit_lower_solve on one C x C block
  with `width` right-hand columns: up to SOLVE_BLOCK rows 2 C^2 W plus
  (ceil(log2 C) - 1) squarings of 2 C^3 + 2 C^2 W; above, the inverse by halves
  and one 2 C^2 W product."""
  if c > SOLVE_BLOCK:
    return _lower_inverse_flops(c) + 2 * c * c * width
  rounds = max(0, math.ceil(math.log2(c)) - 1) if c > 1 else 0
  return 2 * c * c * width + rounds * (2 * c**3 + 2 * c * c * width)


def delta_rule_flops_per_token(
  heads: int, key_dim: int, value_dim: int, chunk: int = LINEAR_CHUNK
) -> float:
  """Forward matmul FLOPs per token of the chunked delta rule as
  lctx.kernels.delta_rule computes it, for `heads` (value) heads of key dim K and
  value dim V in chunks of C tokens. Per chunk and head: the strictly lower
  k k^T 2C^2 K; the in-chunk solve (I + L) X = [beta V | beta Gamma K] by
  matmuls (`unit_lower_solve_flops` with V + K columns); the state read, update
  and output read, 3 x 2CKV; the in-chunk q k^T 2C^2 K and its product with the
  new values 2C^2 V. Elementwise work is not counted."""
  c, k, v = chunk, key_dim, value_dim
  per_chunk = (
    2 * c * c * k
    + unit_lower_solve_flops(c, v + k)
    + 3 * 2 * c * k * v
    + 2 * c * c * k
    + 2 * c * c * v
  )
  return heads * per_chunk / c


def linear_mixer_flops(c: ModelConfig) -> float:
  """Forward FLOPs per token of one linear layer's sequence work: the chunked delta
  rule over the value heads (`delta_rule_flops_per_token`); its projections and
  conv are `2 x linear_layer_params`."""
  return delta_rule_flops_per_token(
    c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
  )


def linear_layer_flops(c: ModelConfig, seq_len: int) -> float:
  """Forward FLOPs per token of one linear layer's token mixer: 2 x its weights
  (projections and the depthwise conv's taps) plus the chunked delta rule
  (`linear_mixer_flops`, independent of the length: the model's linear cost)."""
  del seq_len
  return 2.0 * linear_layer_params(c) + linear_mixer_flops(c)


def _validate_gemma_options(c: ModelConfig) -> None:
  """The Gemma-family fields: activation, scales, per-layer-type RoPE."""
  if c.mlp_activation not in MLP_ACTIVATIONS:
    raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}; got {c.mlp_activation!r}")
  for name in ("query_pre_attn_scalar", "sliding_rope_theta", "final_logit_softcap"):
    value = getattr(c, name)
    if value is not None and not value > 0:
      raise ValueError(f"{name} must be None or > 0; got {value!r}")
  if c.sliding_rope_scaling and c.sliding_rope_theta is None:
    raise ValueError("sliding_rope_scaling needs sliding_rope_theta (the sliding layers' base)")
  rope.validate_scaling(dict(c.sliding_rope_scaling) or None)
