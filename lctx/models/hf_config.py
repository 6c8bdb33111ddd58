"""Hugging Face `config.json` <-> ModelConfig, for the families lctx can run exactly.

Families (the `architectures` entry of config.json):
  LlamaForCausalLM    Llama 2, 3, 3.1 (rope_type llama3), 3.2 (tied embeddings);
  MistralForCausalLM  with or without `sliding_window`;
  Qwen2ForCausalLM    q/k/v biases, often tied embeddings;
  Qwen3ForCausalLM    RMSNorm on q and k per head, a free `head_dim`;
  Qwen3_5ForCausalLM, Qwen3NextForCausalLM, KimiLinearForCausalLM
                      hybrids with linear-attention layers (lctx.models.hf_hybrid);
  Gemma3ForCausalLM   (1 + weight) norms before and after each sub-layer, q/k norms,
                      GELU-tanh MLP, sqrt(d_model) embedding scale, sliding and
                      global layers (`layer_types`) with RoPE per layer type;
  Gemma3ForConditionalGeneration  its language model only (the vision tower and
                      projector are left unread).
Gemma 3 is mapped in lctx/models/hf_gemma.py. Everything else is refused with
one ValueError naming the architecture or the field, before any tensor is read.
Defaults for absent keys are those of the
transformers config classes (e.g. Mistral's sliding_window 4096, Qwen3's head_dim 128).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lctx.models import config as config_lib
from lctx.models import hf_gemma, hf_hybrid
from lctx.models.config import ModelConfig
from lctx.models.hf_names import (  # noqa: F401  (re-exported)
  _MOE_KEYS,
  _REFUSED,
  _ROPE_NON_SCALING,
  ARCHITECTURES,
  GEMMA3_ARCHITECTURES,
  GEMMA3_MODEL_TYPES,
  MODEL_TYPES,
  _refuse_if,
  _rope,
  architecture_of,
  decoder_fields,
  read_config_json,
)

SHAPE_FIELDS = config_lib.SHAPE_FIELDS


def config_from_hf(hf: Mapping[str, Any], where: str = "config.json", **overrides) -> ModelConfig:
  """The ModelConfig of an HF config dict; `overrides` set non-shape fields (dtypes...)."""
  arch = architecture_of(hf, where)
  if arch in hf_hybrid.ARCHITECTURES:
    return _build(hf_hybrid.fields_from_hf(hf, arch, where, _rope), overrides, where, arch)
  if arch in GEMMA3_ARCHITECTURES:
    return _gemma3_config(hf, arch, where, overrides)
  for key in _MOE_KEYS:
    _refuse_if(bool(hf.get(key)), where, arch, key, hf.get(key), "mixture-of-experts layers")
  act = hf.get("hidden_act", "silu")
  _refuse_if(act != "silu", where, arch, "hidden_act", act, "lctx's MLP is SwiGLU (silu)")
  _refuse_if(bool(hf.get("mlp_bias")), where, arch, "mlp_bias", True, "the MLP has no biases")
  for key in ("use_sliding_window",):
    _refuse_if(bool(hf.get(key)), where, arch, key, hf.get(key), "per-layer windows")
  layer_types = set(hf.get("layer_types") or ()) - {"full_attention"}
  _refuse_if(bool(layer_types), where, arch, "layer_types", sorted(layer_types), "only full")
  heads = int(hf["num_attention_heads"])
  d_model = int(hf["hidden_size"])
  head_dim_default = 128 if arch == "Qwen3ForCausalLM" else d_model // heads
  if arch == "Qwen2ForCausalLM":  # Qwen2 has no head_dim key: always d_model / heads
    head_dim = head_dim_default
  else:
    head_dim = int(hf.get("head_dim") or head_dim_default)
  # Llama/Mistral/Qwen3 attention_bias also puts a bias on o_proj, which lctx lacks.
  bias = hf.get("attention_bias", False)
  _refuse_if(bool(bias) and arch != "Qwen2ForCausalLM", where, arch, "attention_bias", bias,
             "an output-projection bias")  # fmt: skip
  window = hf.get("sliding_window", 4096) if arch == "MistralForCausalLM" else None
  theta, scaling = _rope(hf, where)
  fields = dict(
    vocab_size=int(hf["vocab_size"]),
    d_model=d_model,
    num_layers=int(hf["num_hidden_layers"]),
    num_heads=heads,
    num_kv_heads=int(hf.get("num_key_value_heads") or heads),
    head_dim=head_dim,
    mlp_dim=int(hf["intermediate_size"]),
    rope_theta=theta,
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    attention_pattern=(None if window is None else int(window),),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    rope_scaling=scaling or (),
    qkv_bias=arch == "Qwen2ForCausalLM",
    qk_norm=arch == "Qwen3ForCausalLM",
  )
  return _build(fields, overrides, where, arch)


def _build(fields: dict[str, Any], overrides, where: str, arch: str) -> ModelConfig:
  fields.update(overrides)
  try:
    return ModelConfig(**fields)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: {arch} maps to an invalid ModelConfig: {e}") from e


def load_config(path: str, **overrides) -> ModelConfig:
  """ModelConfig of an HF directory's config.json (or of the file itself)."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  return config_from_hf(read_config_json(path), file, **overrides)


def check_shape_fields(expected: ModelConfig, given: ModelConfig, where: str) -> None:
  """A ValueError naming every SHAPE_FIELDS field where `given` differs from the checkpoint."""

  def value(c: ModelConfig, f: str):
    if f == "layer_types":  # which layers are linear; sliding vs full is free
      return tuple(c.layer_type_of(i) == "linear_attention" for i in range(c.num_layers))
    return getattr(c, f)

  diffs = [
    f"{f}: checkpoint has {getattr(expected, f)!r}, config has {getattr(given, f)!r}"
    for f in SHAPE_FIELDS
    if value(expected, f) != value(given, f)
  ]
  if diffs:
    raise ValueError(
      f"{where}: the model config does not match the checkpoint: " + "; ".join(diffs)
    )


def architecture_for(config: ModelConfig) -> str:
  """The HF family that expresses `config` exactly, or a ValueError naming the field."""
  hybrid = hf_hybrid.default_architecture(config)
  if hybrid is not None:
    hf_hybrid.check_exportable(config, hybrid)
    return hybrid
  if _gemma3_export_check(config):
    return "Gemma3ForCausalLM"
  windows = set(config.attention_pattern)
  if config.attention != "mha_gqa":
    raise ValueError(f"attention={config.attention!r}: only mha_gqa exports to Hugging Face")
  if config.qk_norm and config.qkv_bias:
    raise ValueError("qk_norm with qkv_bias: no Hugging Face family has both (Qwen3 has no bias)")
  if len(windows) > 1:
    raise ValueError(
      f"attention_pattern={config.attention_pattern}: mixed windows have no HF family here"
    )
  window = next(iter(windows))
  if window is not None and (config.qk_norm or config.qkv_bias):
    raise ValueError(f"attention_pattern={config.attention_pattern}: only Mistral has a window")
  if config.qk_norm:
    return "Qwen3ForCausalLM"
  if config.qkv_bias:
    return "Qwen2ForCausalLM"
  return "LlamaForCausalLM" if window is None else "MistralForCausalLM"


def config_to_hf(
  config: ModelConfig,
  dtype: str = "bfloat16",
  max_position_embeddings: int | None = None,
  architecture: str | None = None,
) -> dict[str, Any]:
  """config.json for `config`, readable by transformers 4.x (rope_theta, rope_scaling)
  and 5.x (rope_parameters). max_position_embeddings: informational for these rope
  types; default original_max_position_embeddings x factor when scaled, else 8192.
  architecture: the family to write where several express `config` (a GDN
  hybrid: Qwen3_5ForCausalLM, the default, or Qwen3NextForCausalLM)."""
  arch = architecture_for(config)
  if architecture is not None and architecture != arch:
    if {arch, architecture} != {hf_hybrid.QWEN3_5, hf_hybrid.QWEN3_NEXT}:
      raise ValueError(f"architecture={architecture!r}: this config exports as {arch}")
    arch = architecture
  if arch == "Gemma3ForCausalLM":
    return _gemma3_to_hf(config, dtype, max_position_embeddings)
  model_type = {v: k for k, v in MODEL_TYPES.items()}.get(arch)
  scaling = dict(config.rope_scaling_dict or {})
  if max_position_embeddings is None:
    orig = scaling.get("original_max_position_embeddings")
    max_position_embeddings = int(orig * scaling.get("factor", 1.0)) if orig else 8192
  hf = {
    "architectures": [arch],
    "model_type": model_type,
    **decoder_fields(config),
    "hidden_act": "silu",
    "rms_norm_eps": config.norm_eps,
    "max_position_embeddings": max_position_embeddings,
    "rope_theta": config.rope_theta,
    "rope_scaling": scaling or None,
    "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **scaling},
    "tie_word_embeddings": config.tie_embeddings,
    "torch_dtype": dtype,
    "dtype": dtype,
  }
  if arch in hf_hybrid.ARCHITECTURES:
    return hf_hybrid.config_to_hf(config, arch, hf)
  if arch == "Qwen2ForCausalLM":
    hf.pop("head_dim")  # Qwen2 derives it (= hidden_size / heads, checked below)
    if config.head_dim * config.num_heads != config.d_model:
      raise ValueError(
        f"head_dim={config.head_dim}: Qwen2 needs head_dim x num_heads = d_model ({config.d_model})"
      )
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    hf["use_sliding_window"] = False
  else:
    hf["attention_bias"] = False
    hf["mlp_bias"] = False
  if arch == "Qwen3ForCausalLM":
    hf["attention_bias"] = False
  if arch == "MistralForCausalLM":
    hf["sliding_window"] = config.attention_pattern[0]
  return hf


def _gemma3_config(hf, arch, where, overrides) -> ModelConfig:
  return hf_gemma.gemma3_config(hf, arch, where, overrides)


def _gemma3_export_check(config: ModelConfig) -> bool:
  return hf_gemma.gemma3_export_check(config)


def _gemma3_to_hf(config: ModelConfig, dtype: str, max_position_embeddings: int | None):
  return hf_gemma.gemma3_to_hf(config, dtype, max_position_embeddings)
