"""Size presets (the gin files in gin/models/ bind the same numbers).

Each takes keyword overrides, e.g. `llama3_8b(dtype="bfloat16", remat_policy="full")`.
"""

from __future__ import annotations

from lctx.models.config import ModelConfig


def tiny(**overrides) -> ModelConfig:
  """CPU smoke model: 2 layers, D 64, 4 q / 2 kv heads of 16, F 128, E 256."""
  kw = dict(
    vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128
  )
  return ModelConfig(**{**kw, **overrides})


def llama_100m(**overrides) -> ModelConfig:
  """~75M non-embedding params (+ 2 x E x 768 embeddings; ~124M at E 32000):
  12 layers, D 768, 12 q / 4 kv heads of 64, SwiGLU F 2048 (~8/3 D)."""
  kw = dict(
    vocab_size=32000,
    d_model=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    head_dim=64,
    mlp_dim=2048,
    rope_theta=10000.0,
  )
  return ModelConfig(**{**kw, **overrides})


def llama3_8b(**overrides) -> ModelConfig:
  """Llama-3.1-8B: 32 layers, D 4096, 32 q / 8 kv heads of 128, F 14336, E 128256."""
  kw = dict(
    vocab_size=128256,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=14336,
    rope_theta=500000.0,
  )
  return ModelConfig(**{**kw, **overrides})


def llama3_70b(**overrides) -> ModelConfig:
  """Llama-3.1-70B: 80 layers, D 8192, 64 q / 8 kv heads of 128, F 28672, E 128256."""
  kw = dict(
    vocab_size=128256,
    d_model=8192,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=28672,
    rope_theta=500000.0,
  )
  return ModelConfig(**{**kw, **overrides})
