"""Attention and loss kernels: flash attention (+ reference), chunked loss and MLP.

Where things are:
- options.py: `AttentionOptions`, the one object that carries the attention
  settings (mask, blocks, backend, platform) to every kernel, and their
  validation (the strategies' settings are lctx.parallel.ContextOptions);
- flash.py: `flash_attention` and the ring block API, and the one place a
  backend is chosen (`choose_backend`, by platform and mask);
- blockwise.py / blockwise_core.py: the pure-JAX block-sparse kernel (wrappers,
  custom_vjp, block API / the per-example loop bodies), block_map.py its skip map;
- cpu_fused.py / cpu_build.py: the fused C++ CPU kernel's JAX binding / its
  build, cache and XLA FFI registration (source: cpu_attention.cc);
- splash.py: TPU Pallas splash attention (its entry points; splash_tiling.py the
  block maps and SMEM tiling, splash_calls.py the library's kernel calls,
  splash_vjp.py the custom_vjp); token_order.py: natural / zigzag token orders
  (the one zigzag rule) and the `Layout` of a call's rows;
- jax_nn.py: jax.nn's xla and cudnn;
- reference.py: the dense plain-jnp reference; masking.py: the one mask rule;
- shard_typing.py: typing helpers for loop carries and cotangents in shard_map;
- chunked.py: sequence-chunked cross-entropy and MLP.

Imports nothing else from lctx. See docs/contracts.md for the signatures.
"""

from lctx.kernels.blockwise import blockwise_attention, blockwise_block_counts
from lctx.kernels.chunked import (
  chunked_cross_entropy,
  chunked_mlp,
  chunked_token_scores,
  reference_cross_entropy,
)
from lctx.kernels.cpu_fused import cpu_fused_attention
from lctx.kernels.flash import (
  attention_block_backward,
  attention_block_forward,
  choose_backend,
  flash_attention,
)
from lctx.kernels.jax_nn import xla_attention
from lctx.kernels.masking import MASKED_LSE
from lctx.kernels.options import BACKENDS, PLATFORMS, AttentionOptions
from lctx.kernels.reference import reference_attention
from lctx.kernels.splash import splash_attention

__all__ = [
  "BACKENDS",
  "MASKED_LSE",
  "PLATFORMS",
  "AttentionOptions",
  "attention_block_backward",
  "attention_block_forward",
  "blockwise_attention",
  "blockwise_block_counts",
  "choose_backend",
  "chunked_cross_entropy",
  "chunked_mlp",
  "chunked_token_scores",
  "cpu_fused_attention",
  "flash_attention",
  "reference_attention",
  "reference_cross_entropy",
  "splash_attention",
  "xla_attention",
]
