"""Llama-family decoder models (MHA/GQA/MQA/MLA), logical axis names only.

Public API:
  ModelConfig                  frozen dataclass (+ num_params, flops_per_token)
  Transformer(config, mixer)   mixer: a SequenceMixer (lctx.parallel.mixer) or an attention fn
  reference_attention_fn       default plain-jnp attention plug-in
  unembed_matrix(params, config) -> [D, E]
  stack_unscanned_params(params, config)

Model sizes live in gin/models/*.gin only (lctx.configs.model_config reads one).
"""

from lctx.models.attention import reference_attention_fn
from lctx.models.config import ModelConfig
from lctx.models.transformer import Transformer, stack_unscanned_params, unembed_matrix

__all__ = [
  "ModelConfig",
  "Transformer",
  "reference_attention_fn",
  "unembed_matrix",
  "stack_unscanned_params",
]
