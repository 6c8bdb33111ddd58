"""lctx.data: tokenizers, TFDS sources, the grain packing pipeline, mixtures."""
from lctx.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer, make_tokenizer

__all__ = ["ByteTokenizer", "SentencePieceTokenizer", "Tokenizer", "make_tokenizer"]
