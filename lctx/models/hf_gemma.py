"""Gemma 3 `config.json` <-> ModelConfig (lctx.models.hf_config hands it the family).

Gemma3ForCausalLM (`gemma3_text`) and Gemma3ForConditionalGeneration (`gemma3`:
its `text_config` and the language model's tensors only). A config.json's
absent keys take transformers' Gemma3TextConfig defaults; RoPE comes per layer
type from transformers 5's `rope_parameters` or 4.x's `rope_theta`,
`rope_local_base_freq` and `rope_scaling` (the global layers'). Refused by
field: attention-logit softcapping, bidirectional attention, attention biases,
an activation other than GELU-tanh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lctx.models.config import ModelConfig
from lctx.models.hf_names import _refuse_if, _rope, architecture_of, decoder_fields

# transformers' Gemma3TextConfig defaults, for keys a config.json leaves out
# (the published gemma-3-*-it configs rely on several of them).
_GEMMA3_DEFAULTS = {
  "vocab_size": 262_208,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 26,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-6,
  "query_pre_attn_scalar": 256,
  "sliding_window": 4096,
  "tie_word_embeddings": True,
}
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Multimodal Gemma 3 keeps its decoder under one of these (transformers 5 writes
# the first, 4.5x the second); the rest of the checkpoint is not text.
_GEMMA3_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_GEMMA3_OTHER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector.")  # fmt: skip


def text_prefix(hf: Mapping[str, Any], tensor_names) -> str:
  """Where the decoder's tensors live in a checkpoint ('model.' but for Gemma 3's
  multimodal layouts)."""
  if architecture_of(hf) != "Gemma3ForConditionalGeneration":
    return "model."
  for prefix in _GEMMA3_TEXT_PREFIXES:
    if f"{prefix}embed_tokens.weight" in tensor_names:
      return prefix
  raise ValueError(f"Gemma3ForConditionalGeneration: no embed_tokens under {_GEMMA3_TEXT_PREFIXES}")


def ignored_prefixes(hf: Mapping[str, Any]) -> tuple[str, ...]:
  """Tensors lctx leaves unread: a multimodal checkpoint's vision parts."""
  if architecture_of(hf) == "Gemma3ForConditionalGeneration":
    return _GEMMA3_OTHER_PREFIXES
  return ()


def _gemma3_rope(text: Mapping[str, Any], where: str):
  """{layer type: (theta, scaling)} from transformers 5's per-type rope_parameters
  or 4.x's rope_theta / rope_local_base_freq / rope_scaling (global layers)."""
  params = text.get("rope_parameters") or {}
  if params and not all(isinstance(v, Mapping) for v in params.values()):
    params = {"full_attention": params}  # one dict: the global layers'
  out = {}
  for kind, theta_key in (("full_attention", "rope_theta"), ("sliding_attention",
                                                             "rope_local_base_freq")):  # fmt: skip
    d = dict(params.get(kind) or {})
    if not params and kind == "full_attention" and text.get("rope_scaling"):
      d.update(text["rope_scaling"])
    d.setdefault("rope_theta", text.get(theta_key, _GEMMA3_THETA[kind]))
    out[kind] = _rope({"rope_parameters": d}, f"{where}: rope_parameters[{kind!r}]")
  return out


def gemma3_config(hf, arch, where, overrides) -> ModelConfig:
  text = hf.get("text_config") if arch == "Gemma3ForConditionalGeneration" else hf
  if text is None:
    raise ValueError(f"{where}: {arch} has no text_config")
  text = {**_GEMMA3_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
  if arch == "Gemma3ForConditionalGeneration" and "tie_word_embeddings" in hf:
    text["tie_word_embeddings"] = hf["tie_word_embeddings"]
  act = text["hidden_activation"]
  _refuse_if(act not in ("gelu_pytorch_tanh", "gelu_tanh"), where, arch, "hidden_activation",
             act, "lctx's Gemma MLP is GELU-tanh")  # fmt: skip
  for key, why in (
    ("attn_logit_softcapping", "attention-logit softcapping"),
    ("use_bidirectional_attention", "bidirectional attention"),
    ("attention_bias", "attention biases"),
  ):
    _refuse_if(bool(text.get(key)), where, arch, key, text.get(key), why)
  layers = int(text["num_hidden_layers"])
  layer_types = text.get("layer_types")
  if not layer_types:  # transformers' fallback: every sliding_window_pattern-th is global
    every = int(text.get("sliding_window_pattern", text.get("_sliding_window_pattern", 6)))
    layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                   for i in range(layers)]  # fmt: skip
  ropes = _gemma3_rope(text, where)
  (theta, scaling), (local_theta, local_scaling) = (
    ropes["full_attention"],
    ropes["sliding_attention"],
  )
  fields = dict(
    vocab_size=int(text["vocab_size"]),
    d_model=int(text["hidden_size"]),
    num_layers=layers,
    num_heads=int(text["num_attention_heads"]),
    num_kv_heads=int(text["num_key_value_heads"]),
    head_dim=int(text["head_dim"]),
    mlp_dim=int(text["intermediate_size"]),
    rope_theta=theta,
    rope_scaling=scaling or (),
    norm_eps=float(text["rms_norm_eps"]),
    tie_embeddings=bool(text["tie_word_embeddings"]),
    qk_norm=True,
    layer_types=tuple(layer_types),
    sliding_window=int(text["sliding_window"]) if "sliding_attention" in layer_types else None,
    norm_plus_one=True,
    mlp_activation="gelu_tanh",
    embed_scale=True,
    post_sublayer_norms=True,
    query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
    sliding_rope_theta=local_theta,
    sliding_rope_scaling=local_scaling or (),
    final_logit_softcap=text.get("final_logit_softcapping"),
  )
  fields.update(overrides)
  try:
    return ModelConfig(**fields)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{where}: {arch} maps to an invalid ModelConfig: {e}") from e


_GEMMA3_FIELDS = {
  "norm_plus_one": True,
  "mlp_activation": "gelu_tanh",
  "embed_scale": True,
  "post_sublayer_norms": True,
  "qk_norm": True,
  "qkv_bias": False,
  "attention": "mha_gqa",
}


def gemma3_export_check(config: ModelConfig) -> bool:
  """True for a config Gemma3ForCausalLM expresses; False for one with none of
  Gemma's layer features; a ValueError naming the fields for a mix."""
  marks = ("norm_plus_one", "mlp_activation", "embed_scale", "post_sublayer_norms")
  if not any(getattr(config, f) != ModelConfig.__dataclass_fields__[f].default for f in marks):
    if config.query_pre_attn_scalar or config.sliding_rope_theta or config.final_logit_softcap:
      raise ValueError(
        "query_pre_attn_scalar / sliding_rope_theta / final_logit_softcap: only Gemma 3 "
        "exports them (with its norms, GELU-tanh MLP and embedding scale)"
      )
    return False
  wrong = {f: getattr(config, f) for f, v in _GEMMA3_FIELDS.items() if getattr(config, f) != v}
  if wrong:
    raise ValueError(f"Gemma3ForCausalLM needs {_GEMMA3_FIELDS}; this config has {wrong}")
  windows = {w for w in config.attention_pattern if w is not None}
  if len(windows) > 1:
    raise ValueError(f"attention_pattern={config.attention_pattern}: Gemma 3 has one window")
  return True


def _int_if_whole(x: float) -> int | float:
  """transformers types query_pre_attn_scalar as an int."""
  return int(x) if float(x).is_integer() else float(x)


def gemma3_to_hf(config: ModelConfig, dtype: str, max_position_embeddings: int | None):
  windows = {w for w in config.attention_pattern if w is not None}
  layer_types = ["full_attention" if w is None else "sliding_attention"
                 for w in config.layer_windows]  # fmt: skip

  def rope_dict(theta, scaling):
    return {"rope_type": "default", **dict(scaling or {}), "rope_theta": theta}

  local = config.rope_of(next(iter(windows), 1))
  return {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    **decoder_fields(config),
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": config.norm_eps,
    "max_position_embeddings": max_position_embeddings or 131_072,
    "layer_types": layer_types,
    "sliding_window": next(iter(windows), 4096),
    "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar or config.head_dim),
    "rope_parameters": {
      "full_attention": rope_dict(config.rope_theta, config.rope_scaling),
      "sliding_attention": rope_dict(*local),
    },
    "final_logit_softcapping": config.final_logit_softcap,
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": config.tie_embeddings,
    "torch_dtype": dtype,
    "dtype": dtype,
  }
