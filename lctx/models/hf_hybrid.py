"""The hybrid Hugging Face families: Qwen3.5 and Qwen3-Next (Gated DeltaNet + gated
full attention) and Kimi Linear (KDA + MLA without RoPE), dense MLPs only.

What differs from the Llama-style families of lctx.models.hf_config / hf_layout:
  config.json  `layer_types`, the linear heads and dims, partial rotary (Qwen),
               `linear_attn_config` (Kimi, 1-based layer numbers);
  tensors      fused projections (Qwen3.5 in_proj_qkv and q_proj = [q | gate] per
               head; Qwen3-Next in_proj_qkvz / in_proj_ba grouped per q/k head;
               one conv1d over [q | k | v] channels), read and written as
               `Part`s of the HF tensor;
  norms        Qwen's RMSNorms are zero-centred, x_n * (1 + w): lctx reads
               scale = 1 + w and writes w = scale - 1 (the gated norm inside GDN
               is a plain one).
Mixture-of-experts layers are refused by name: the test is whether any layer
is an MoE layer (Qwen3-Next: not in mlp_only_layers, num_experts > 0 and
(layer + 1) % decoder_sparse_step == 0; Kimi: mlp_layer_types 'sparse', by
default every layer from first_k_dense_replace on), not whether the config
carries num_experts keys.

Shapes legend (docs/contracts.md): D d_model, N heads, H head dim, Q linear q/k
heads, M linear value heads, G = M // Q, K / V linear key / value head dims,
W conv width, C MLA latent, R MLA rope dims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lctx.models.config import ModelConfig, has_linear_layers


@dataclasses.dataclass(frozen=True)
class Part:
  """An lctx param that is a piece of a fused HF tensor (hybrid families: q/k/v/z
  in one projection, q and the output gate in q_proj, one conv over q, k, v).

  The HF tensor as stored has `hf_shape`; its 2-D form (transposed when the
  Entry is: torch [out, in] -> [in, out]; a conv's [C, 1, W] -> [W, C]) reshaped
  to `view` holds the lctx param at `view[..., lo:hi]` (then reshaped to its
  own shape). The parts of one HF tensor tile its last view axis."""

  hf_shape: tuple[int, ...]
  view: tuple[int, ...]
  lo: int
  hi: int


QWEN3_5, QWEN3_NEXT, KIMI = "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "KimiLinearForCausalLM"
ARCHITECTURES = (QWEN3_5, QWEN3_NEXT, KIMI)
MODEL_TYPES = {"qwen3_5_text": QWEN3_5, "qwen3_next": QWEN3_NEXT, "kimi_linear": KIMI}
REFUSED_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
# rope_parameters keys that are not a scaling schedule (Qwen3.5's multimodal
# sections are the identity on text: its three position rows are equal).
ROPE_EXTRA_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


# ----------------------------------------------------------------------------
# Tensor layout
# ----------------------------------------------------------------------------
def default_architecture(c: ModelConfig) -> str | None:
  """The hybrid family `c` exports to, or None (a Llama-style family)."""
  kda = has_linear_layers(c) and c.linear_attention == "kda"
  if kda or (c.attention == "mla" and not c.mla_rope):
    return KIMI
  if has_linear_layers(c) or c.attention_output_gate:
    return QWEN3_5
  return None


def check_exportable(c: ModelConfig, arch: str) -> None:
  """A ValueError naming the field when `c` is not exactly `arch`."""
  if arch == KIMI:
    bad = [
      (has_linear_layers(c) and c.linear_attention != "kda", "linear_attention", "'kda'"),
      ("full_attention" in c.layer_types and c.attention != "mla", "attention", "'mla'"),
      (c.attention == "mla" and c.mla_rope, "mla_rope", "False"),
      (c.linear_key_head_dim != c.linear_value_head_dim, "linear_value_head_dim", "the key dim"),
      ("sliding_attention" in c.layer_types, "layer_types", "no sliding layers"),
    ]
  else:
    bad = [
      (has_linear_layers(c) and c.linear_attention != "gated_deltanet", "linear_attention",
       "'gated_deltanet'"),
      (c.attention != "mha_gqa", "attention", "'mha_gqa'"),
      (not (c.qk_norm and c.attention_output_gate), "qk_norm / attention_output_gate", "True"),
      (c.qkv_bias, "qkv_bias", "False"),
      ("sliding_attention" in c.layer_types, "layer_types", "no sliding layers"),
    ]  # fmt: skip
  for cond, field, want in bad:
    if cond:
      raise ValueError(f"{arch} export: {field} must be {want}")


def layer_rules(c: ModelConfig, arch: str | None) -> dict[tuple[str, ...], tuple]:
  """lctx sub-path (inside a decoder layer) -> (HF name, transposed, split[, offset,
  Part]) for the hybrid families; {} for the others (hf_layout's rules)."""
  if arch not in ARCHITECTURES:
    return {}
  d, n = c.d_model, c.num_heads
  q, m = c.linear_num_key_heads, c.linear_num_value_heads
  k, v, w = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
  qk, mv = q * k, m * v
  conv = Part((2 * qk + mv, 1, w), (w, 2 * qk + mv), 0, 0)

  def piece(part, lo, hi):
    return Part(part.hf_shape, part.view, lo, hi)

  def whole_conv(channels):  # [C, 1, W] -> [W, C]
    return Part((channels, 1, w), (w, channels), 0, channels)

  def conv_rules(prefix):
    name = f"{prefix}.conv1d.weight"
    return {
      ("linear_attention", "conv_q"): (name, True, 1, 0.0, piece(conv, 0, qk)),
      ("linear_attention", "conv_k"): (name, True, 1, 0.0, piece(conv, qk, 2 * qk)),
      ("linear_attention", "conv_v"): (name, True, 1, 0.0, piece(conv, 2 * qk, 2 * qk + mv)),
    }

  if arch == KIMI:
    a = "self_attn"
    return {
      ("attention", "wq"): (f"{a}.q_proj.weight", True, 1),
      ("attention", "wq_a"): (f"{a}.q_a_proj.weight", True, 1),
      ("attention", "q_norm", "scale"): (f"{a}.q_a_layernorm.weight", False, 1),
      ("attention", "wq_b"): (f"{a}.q_b_proj.weight", True, 1),
      ("attention", "wkv_a"): (f"{a}.kv_a_proj_with_mqa.weight", True, 1),
      ("attention", "kv_norm", "scale"): (f"{a}.kv_a_layernorm.weight", False, 1),
      ("attention", "wkv_b"): (f"{a}.kv_b_proj.weight", True, 1),
      ("attention", "wo"): (f"{a}.o_proj.weight", True, 2),
      ("linear_attention", "wq"): (f"{a}.q_proj.weight", True, 1),
      ("linear_attention", "wk"): (f"{a}.k_proj.weight", True, 1),
      ("linear_attention", "wv"): (f"{a}.v_proj.weight", True, 1),
      ("linear_attention", "wb"): (f"{a}.b_proj.weight", True, 1),
      ("linear_attention", "wf_a"): (f"{a}.f_a_proj.weight", True, 1),
      ("linear_attention", "wf_b"): (f"{a}.f_b_proj.weight", True, 1),
      ("linear_attention", "dt_bias"): (f"{a}.dt_bias", False, 2),
      ("linear_attention", "A_log"): (f"{a}.A_log", False, 1, 0.0, Part((1, 1, m, 1), (m,), 0, m)),
      ("linear_attention", "wg_a"): (f"{a}.g_a_proj.weight", True, 1),
      ("linear_attention", "wg_b"): (f"{a}.g_b_proj.weight", True, 1),
      ("linear_attention", "norm_scale"): (f"{a}.o_norm.weight", False, 1),
      ("linear_attention", "wo"): (f"{a}.o_proj.weight", True, 2),
      # Kimi's checkpoints keep one conv per projection.
      ("linear_attention", "conv_q"): (f"{a}.q_conv1d.weight", True, 1, 0.0, whole_conv(qk)),
      ("linear_attention", "conv_k"): (f"{a}.k_conv1d.weight", True, 1, 0.0, whole_conv(qk)),
      ("linear_attention", "conv_v"): (f"{a}.v_conv1d.weight", True, 1, 0.0, whole_conv(mv)),
    }
  h = c.head_dim
  qg = Part((2 * n * h, d), (d, n, 2 * h), 0, 0)  # q_proj: per head [q | gate]
  rules = {
    ("attn_norm", "scale"): ("input_layernorm.weight", False, 1, 1.0),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False, 1, 1.0),
    ("attention", "q_norm", "scale"): ("self_attn.q_norm.weight", False, 1, 1.0),
    ("attention", "k_norm", "scale"): ("self_attn.k_norm.weight", False, 1, 1.0),
    ("attention", "wq"): ("self_attn.q_proj.weight", True, 1, 0.0, piece(qg, 0, h)),
    ("attention", "wg"): ("self_attn.q_proj.weight", True, 1, 0.0, piece(qg, h, 2 * h)),
    ("linear_attention", "dt_bias"): ("linear_attn.dt_bias", False, 1),
    ("linear_attention", "A_log"): ("linear_attn.A_log", False, 1),
    ("linear_attention", "norm_scale"): ("linear_attn.norm.weight", False, 1),
    ("linear_attention", "wo"): ("linear_attn.out_proj.weight", True, 2),
    **conv_rules("linear_attn"),
  }
  if arch == QWEN3_5:
    qkv = Part((2 * qk + mv, d), (d, 2 * qk + mv), 0, 0)
    name = "linear_attn.in_proj_qkv.weight"
    rules.update({
      ("linear_attention", "wq"): (name, True, 1, 0.0, piece(qkv, 0, qk)),
      ("linear_attention", "wk"): (name, True, 1, 0.0, piece(qkv, qk, 2 * qk)),
      ("linear_attention", "wv"): (name, True, 1, 0.0, piece(qkv, 2 * qk, 2 * qk + mv)),
      ("linear_attention", "wz"): ("linear_attn.in_proj_z.weight", True, 1),
      ("linear_attention", "wb"): ("linear_attn.in_proj_b.weight", True, 1),
      ("linear_attention", "wa"): ("linear_attn.in_proj_a.weight", True, 1),
    })  # fmt: skip
  else:  # Qwen3-Next: [q | k | v | z] and [b | a] grouped per q/k head
    gv, g = m // q * v, m // q
    qkvz = Part((q * (2 * k + 2 * gv), d), (d, q, 2 * k + 2 * gv), 0, 0)
    ba = Part((2 * m, d), (d, q, 2 * g), 0, 0)
    name, name_ba = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
    rules.update({
      ("linear_attention", "wq"): (name, True, 1, 0.0, piece(qkvz, 0, k)),
      ("linear_attention", "wk"): (name, True, 1, 0.0, piece(qkvz, k, 2 * k)),
      ("linear_attention", "wv"): (name, True, 1, 0.0, piece(qkvz, 2 * k, 2 * k + gv)),
      ("linear_attention", "wz"): (name, True, 1, 0.0, piece(qkvz, 2 * k + gv, 2 * k + 2 * gv)),
      ("linear_attention", "wb"): (name_ba, True, 1, 0.0, piece(ba, 0, g)),
      ("linear_attention", "wa"): (name_ba, True, 1, 0.0, piece(ba, g, 2 * g)),
    })  # fmt: skip
  return rules


def stored_name(arch: str | None, name: str, present) -> str:
  """The name under which a checkpoint holds the tensor lctx calls `name`:
  transformers writes Kimi Linear's dense MLPs as `block_sparse_moe.*` (and reads
  them back as `mlp.*`); Moonshot's own checkpoints say `mlp.`."""
  if arch == KIMI and ".mlp." in name and name not in present:
    alias = name.replace(".mlp.", ".block_sparse_moe.")
    if alias in present:
      return alias
  return name


def top_rules(arch: str | None) -> dict[tuple[str, ...], tuple]:
  """Top-level params whose rule differs from Llama's (Qwen's zero-centred final norm)."""
  if arch in (QWEN3_5, QWEN3_NEXT):
    return {("final_norm", "scale"): ("model.norm.weight", False, 1, 1.0)}
  return {}


# ----------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------
def moe_layers(hf: Mapping[str, Any], arch: str) -> list[int]:
  """The layers of an HF hybrid config that are mixture-of-experts layers."""
  layers = int(hf["num_hidden_layers"])
  if arch == QWEN3_NEXT:
    dense = set(hf.get("mlp_only_layers") or ())
    experts, step = int(hf.get("num_experts", 512) or 0), int(hf.get("decoder_sparse_step", 1))
    return [i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0]
  if arch == KIMI:
    types = hf.get("mlp_layer_types")
    if types is None:
      first_dense = int(hf.get("first_k_dense_replace", 1))
      types = ["dense" if i < first_dense else "sparse" for i in range(layers)]
    return [i for i, t in enumerate(types) if t == "sparse"]
  return []


def fields_from_hf(hf: Mapping[str, Any], arch: str, where: str, rope_fn) -> dict[str, Any]:
  """ModelConfig fields of a hybrid family's config.json (ValueError naming the
  field for what lctx cannot run). rope_fn: hf_config's (theta, scaling) reader."""
  moe = moe_layers(hf, arch)
  if moe:
    shown = moe[:8] + (["..."] if len(moe) > 8 else [])
    raise ValueError(
      f"{where}: {arch} with mixture-of-experts layers {shown} is not supported "
      "(lctx runs dense MLPs: Qwen3-Next needs mlp_only_layers listing every layer, "
      "Kimi Linear mlp_layer_types all 'dense')"
    )
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{where}: {arch} with hidden_act={act!r}: lctx's MLP is SwiGLU (silu)")
  if hf.get("attention_bias"):
    raise ValueError(f"{where}: {arch} with attention_bias=True is not supported")
  layers = int(hf["num_hidden_layers"])
  heads = int(hf["num_attention_heads"])
  common = dict(
    vocab_size=int(hf["vocab_size"]),
    d_model=int(hf["hidden_size"]),
    num_layers=layers,
    num_heads=heads,
    mlp_dim=int(hf["intermediate_size"]),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )
  if arch == KIMI:
    lin = dict(hf.get("linear_attn_config") or {})
    types = hf.get("layer_types") or _kimi_layer_types(lin, layers)
    lh = int(lin.get("num_heads", hf.get("linear_num_heads", 32)))
    ld = int(lin.get("head_dim", hf.get("linear_head_dim", 128)))
    return dict(
      common,
      norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
      layer_types=tuple(types),
      attention="mla",
      mla_rope=False,
      q_lora_rank=int(hf.get("q_lora_rank") or 0),
      kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
      qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
      qk_rope_head_dim=int(hf.get("qk_rope_head_dim", 64)),
      v_head_dim=int(hf.get("v_head_dim") or 128),
      linear_attention="kda",
      linear_num_key_heads=lh,
      linear_num_value_heads=lh,
      linear_key_head_dim=ld,
      linear_value_head_dim=ld,
      linear_conv_kernel_dim=int(
        lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))
      ),
    )
  params = dict(hf.get("rope_parameters") or {})
  partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
  stripped = {
    **{k_: v_ for k_, v_ in hf.items() if k_ not in ("rope_parameters", "partial_rotary_factor")},
    "rope_parameters": {k_: v_ for k_, v_ in params.items() if k_ not in ROPE_EXTRA_KEYS},
  }
  theta, scaling = rope_fn(stripped, where)
  interval = int(hf.get("full_attention_interval", 4))
  types = hf.get("layer_types") or [
    "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
  ]
  return dict(
    common,
    num_kv_heads=int(hf.get("num_key_value_heads") or heads),
    head_dim=int(hf.get("head_dim") or 256),
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    rope_theta=theta,
    rope_scaling=scaling or (),
    partial_rotary_factor=partial,
    qk_norm=True,
    attention_output_gate=True,
    layer_types=tuple(types),
    linear_attention="gated_deltanet",
    linear_num_key_heads=int(hf.get("linear_num_key_heads", 16)),
    linear_num_value_heads=int(hf.get("linear_num_value_heads", 32)),
    linear_key_head_dim=int(hf.get("linear_key_head_dim", 128)),
    linear_value_head_dim=int(hf.get("linear_value_head_dim", 128)),
    linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)),
  )


def _kimi_layer_types(lin: Mapping[str, Any], layers: int) -> list[str]:
  """transformers' KimiLinearConfig rule: linear_attn_config's 1-based lists, else
  full attention at every layer i > 0 with i % 4 == 0."""
  if "full_attn_layers" in lin and "kda_layers" in lin:
    types = [None] * layers
    for i in lin["full_attn_layers"]:
      types[i - 1] = "full_attention"
    for i in lin["kda_layers"]:
      types[i - 1] = "linear_attention"
    return types
  return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def config_to_hf(c: ModelConfig, arch: str, base: dict[str, Any]) -> dict[str, Any]:
  """config.json of a hybrid family; `base` holds the Llama-style keys
  (vocab, sizes, rope, dtype) that hf_config writes for every family."""
  check_exportable(c, arch)
  types = list(c.layer_types) or ["full_attention"] * c.num_layers
  hf = {
    **base,
    "architectures": [arch],
    "model_type": {v_: k_ for k_, v_ in MODEL_TYPES.items()}[arch],
    "layer_types": types,
    "attention_bias": False,
    "tie_word_embeddings": c.tie_embeddings,
  }
  for key in ("rope_scaling", "rope_theta", "head_dim", "use_sliding_window", "mlp_bias"):
    hf.pop(key, None)
  if arch == KIMI:
    for key in ("rope_parameters",):
      hf.pop(key, None)
    hf.update(
      num_key_value_heads=c.num_heads,
      q_lora_rank=c.q_lora_rank or None,
      kv_lora_rank=c.kv_lora_rank,
      qk_nope_head_dim=c.qk_nope_head_dim,
      qk_rope_head_dim=c.qk_rope_head_dim,
      v_head_dim=c.v_head_dim,
      mlp_layer_types=["dense"] * c.num_layers,
      linear_attn_config={
        "head_dim": c.linear_key_head_dim,
        "num_heads": c.linear_num_value_heads,
        "short_conv_kernel_size": c.linear_conv_kernel_dim,
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
      },
      pad_token_id=None,
      bos_token_id=None,
      eos_token_id=None,
    )
    return hf
  hf["head_dim"] = c.head_dim
  hf["rope_parameters"] = {
    **hf["rope_parameters"],
    "partial_rotary_factor": c.partial_rotary_factor,
  }
  hf.update(
    linear_num_key_heads=c.linear_num_key_heads,
    linear_num_value_heads=c.linear_num_value_heads,
    linear_key_head_dim=c.linear_key_head_dim,
    linear_value_head_dim=c.linear_value_head_dim,
    linear_conv_kernel_dim=c.linear_conv_kernel_dim,
  )
  if arch == QWEN3_NEXT:
    hf.update(mlp_only_layers=list(range(c.num_layers)), decoder_sparse_step=1)
  return hf
