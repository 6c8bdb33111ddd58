"""Attention and loss kernels: flash attention (+ reference), chunked loss and MLP.

flash_attention's backends: pure-JAX blockwise, a fused C++ kernel for the XLA
CPU backend (cpu_fused.py, built on first use), splash (TPU), cuDNN (GPU).

Imports nothing else from lctx. See docs/contracts.md for the signatures.
"""

from lctx.kernels.backends import BACKENDS, flash_attention, splash_attention, xla_attention
from lctx.kernels.blockwise import (
  attention_block_backward,
  attention_block_forward,
  blockwise_attention,
  blockwise_block_counts,
)
from lctx.kernels.chunked import chunked_cross_entropy, chunked_mlp, reference_cross_entropy
from lctx.kernels.cpu_fused import cpu_fused_attention
from lctx.kernels.masking import MASKED_LSE
from lctx.kernels.reference import reference_attention

__all__ = [
  "BACKENDS",
  "MASKED_LSE",
  "attention_block_backward",
  "attention_block_forward",
  "blockwise_attention",
  "blockwise_block_counts",
  "chunked_cross_entropy",
  "chunked_mlp",
  "cpu_fused_attention",
  "flash_attention",
  "reference_attention",
  "reference_cross_entropy",
  "splash_attention",
  "xla_attention",
]
