"""lctx: long-context language-model training in JAX."""

__version__ = "0.1.0"
