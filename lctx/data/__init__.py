"""lctx.data: tokenizers, TFDS sources, the grain packing pipeline, mixtures.

Public entry points (see each docstring):
  DataConfig, make_iterator, make_dataset   the training/eval batch stream
  inspect_data                              packing report (main.py --mode=inspect_data)
  make_tokenizer_for, load_documents        tokenizer and held-out texts for evals
  register_task_source                      synthetic sources defined above data
  skipped_rows                              bad rows skipped (DataConfig.skip_bad_rows)
  encode_chat, render_chat, ChatError       conversations through a chat template
  make_tokenizer, ByteTokenizer, SentencePieceTokenizer, HFTokenizer
  prepare_text_corpus, open_text_corpus, open_tfds   document sources

Names resolve lazily, so `from lctx.data import make_tokenizer` does not import
tensorflow_datasets or grain (the evals and tests that only tokenize stay fast).
"""

import importlib

_EXPORTS = {
  "ByteTokenizer": "tokenizers",
  "SentencePieceTokenizer": "tokenizers",
  "HFTokenizer": "tokenizers",
  "Tokenizer": "tokenizers",
  "make_tokenizer": "tokenizers",
  "default_data_dir": "sources",
  "open_text_corpus": "sources",
  "open_tfds": "sources",
  "prepare_text_corpus": "sources",
  "DataConfig": "pipeline",
  "make_dataset": "pipeline",
  "make_iterator": "pipeline",
  "make_tokenizer_for": "pipeline",
  "load_documents": "pipeline",
  "register_task_source": "pipeline",
  "skipped_rows": "pipeline",
  "SourceSpec": "specs",
  "task_source_names": "pipeline",
  "inspect_data": "inspect",
  "encode_chat": "chat",
  "render_chat": "chat",
  "ChatError": "chat",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"lctx.data.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'lctx.data' has no attribute {name!r}")
