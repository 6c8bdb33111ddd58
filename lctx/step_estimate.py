"""Old import path of lctx.sizing.step_estimate (kept for scripts and users)."""

import sys

from lctx.sizing import step_estimate as _module

sys.modules[__name__] = _module
