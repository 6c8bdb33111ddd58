"""Old import path of lctx.sizing.tpu (kept for scripts and users)."""

import sys

from lctx.sizing import tpu as _module

sys.modules[__name__] = _module
