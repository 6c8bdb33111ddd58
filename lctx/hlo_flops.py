"""Old import path of lctx.sizing.hlo_flops (kept for scripts and users)."""

import sys

from lctx.sizing import hlo_flops as _module

sys.modules[__name__] = _module
