"""Attention and loss kernels: flash attention (+ reference), chunked loss and MLP.

Imports nothing else from lctx.
"""
from lctx.kernels.chunked import chunked_cross_entropy, chunked_mlp, reference_cross_entropy
from lctx.kernels.masking import MASKED_LSE
from lctx.kernels.reference import reference_attention

__all__ = [
    "MASKED_LSE",
    "chunked_cross_entropy",
    "chunked_mlp",
    "reference_attention",
    "reference_cross_entropy",
]
