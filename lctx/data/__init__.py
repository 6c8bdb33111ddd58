"""lctx.data: tokenizers, TFDS sources, the grain packing pipeline, mixtures.

Public entry points (see each docstring):
  DataConfig, make_iterator, make_dataset   the training/eval batch stream
  inspect_data                              packing report (main.py --mode=inspect_data)
  make_tokenizer, ByteTokenizer, SentencePieceTokenizer
  prepare_text_corpus, open_text_corpus, open_tfds   document sources
"""
from lctx.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer, make_tokenizer
from lctx.data.sources import default_data_dir, open_text_corpus, open_tfds, prepare_text_corpus
from lctx.data.pipeline import DataConfig, make_dataset, make_iterator

__all__ = [
    "ByteTokenizer", "SentencePieceTokenizer", "Tokenizer", "make_tokenizer",
    "default_data_dir", "open_text_corpus", "open_tfds", "prepare_text_corpus",
    "DataConfig", "make_dataset", "make_iterator",
]
