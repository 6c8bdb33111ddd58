"""The Hugging Face families lctx reads and the config.json helpers their
mappings share (lctx.models.hf_config, hf_gemma, hf_hybrid): architecture names,
refusals, RoPE settings. Kept apart so the per-family modules import it, not
each other."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from lctx.models import hf_hybrid, rope

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA3_MODEL_TYPES = {"gemma3_text": GEMMA3_ARCHITECTURES[0], "gemma3": GEMMA3_ARCHITECTURES[1]}
ARCHITECTURES = (
  "LlamaForCausalLM",
  "MistralForCausalLM",
  "Qwen2ForCausalLM",
  "Qwen3ForCausalLM",
)
MODEL_TYPES = dict(zip(("llama", "mistral", "qwen2", "qwen3"), ARCHITECTURES))
_REFUSED = {
  "mixture-of-experts layers": (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
  ),
  "Gemma-style layers other than Gemma 3's (Gemma 1's single norms; Gemma 2's "
  "attention-logit softcapping)": (
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
  ),
}
# Keys whose presence (with a value that means "on") marks an unsupported feature.
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# rope dict keys that are not scaling parameters (they live elsewhere in ModelConfig).
_ROPE_NON_SCALING = ("rope_theta", "rope_type", "type", "partial_rotary_factor")
# The ModelConfig fields that decide parameter shapes (and so must match a checkpoint).


def read_config_json(path: str) -> dict[str, Any]:
  """config.json of an HF directory (or the file itself) as a dict."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise ValueError(f"{file}: no config.json (an HF directory holds config.json + safetensors)")
  try:
    with open(file) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file}: not valid JSON ({e})") from e


def architecture_of(hf: Mapping[str, Any], where: str = "config.json") -> str:
  model_types = {**MODEL_TYPES, **hf_hybrid.MODEL_TYPES, **GEMMA3_MODEL_TYPES}
  archs = hf.get("architectures") or [model_types.get(hf.get("model_type"), hf.get("model_type"))]
  if len(archs) != 1:
    raise ValueError(f"{where}: architectures={archs}: expected exactly one")
  arch = archs[0]
  for why, names in _REFUSED.items():
    if arch in names:
      raise ValueError(f"{where}: architecture {arch} is not supported: it has {why}")
  if arch in hf_hybrid.REFUSED_MOE:
    raise ValueError(
      f"{where}: architecture {arch} is not supported: it has mixture-of-experts layers"
    )
  known = ARCHITECTURES + hf_hybrid.ARCHITECTURES + GEMMA3_ARCHITECTURES
  if arch not in known:
    raise ValueError(
      f"{where}: architecture {arch!r} is not supported; lctx reads {', '.join(known)}"
    )
  return arch


def _rope(hf: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
  """(rope_theta, the rope_scaling dict or None) from either transformers layout:
  v5 `rope_parameters` (theta inside) or v4 `rope_theta` + `rope_scaling`."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  if params and all(isinstance(v, Mapping) for v in params.values()):
    raise ValueError(f"{where}: per-layer-type rope_parameters {sorted(params)} are not supported")
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"{where}: partial_rotary_factor={partial} is not supported (only 1.0)")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in rope.SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"{where}: rope_type {rope_type!r} is not supported; lctx computes {rope.SUPPORTED_ROPE_TYPES}"
    )
  if rope_type == "default":
    return theta, None
  scaling = {k: v for k, v in params.items() if k not in _ROPE_NON_SCALING and v is not None}
  scaling["rope_type"] = rope_type
  if rope_type in ("llama3", "yarn"):  # transformers' fallback: the config's own length
    scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if scaling["original_max_position_embeddings"] is None:
      raise ValueError(f"{where}: rope_type {rope_type} needs original_max_position_embeddings")
  if rope_type == "yarn" and "factor" not in scaling:
    scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
  if "factor" not in scaling:
    raise ValueError(f"{where}: rope_type {rope_type} needs a factor")
  return theta, scaling


def _refuse_if(cond: bool, where: str, arch: str, field: str, value: Any, why: str) -> None:
  if cond:
    raise ValueError(f"{where}: {arch} with {field}={value!r} is not supported: {why}")


def decoder_fields(config) -> dict[str, Any]:
  """The config.json sizes every exported family shares (a ModelConfig's)."""
  return {
    "vocab_size": config.vocab_size,
    "hidden_size": config.d_model,
    "intermediate_size": config.mlp_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
  }
