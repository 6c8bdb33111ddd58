"""Old import path of lctx.sizing.memory_model (kept for scripts and users; lctx
itself imports the attention buffers from lctx.parallel.attention_memory)."""

import sys

from lctx.sizing import memory_model as _module

sys.modules[__name__] = _module
