"""Old import path of lctx.sizing.planner (kept for scripts and users)."""

import sys

from lctx.sizing import planner as _module

sys.modules[__name__] = _module
