"""Old import path of lctx.sizing.gpu (kept for scripts and users)."""

import sys

from lctx.sizing import gpu as _module

sys.modules[__name__] = _module
