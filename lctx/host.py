"""Process-level settings of the host that runs the CPU backend.

On the CPU backend every device buffer and every per-step temporary is host
`malloc` memory. glibc serves large requests with fresh `mmap`s and unmaps them
on free, so each train step page-faults its temporaries in again (on the
MaxText peer benchmark, gin/bench/maxtext_cpu_peer.gin, a large share of each
step went to kernel time: docs/benchmarks.md, "Figures moved from code comments").
`keep_freed_memory` makes glibc reuse freed memory instead, the way an
accelerator runtime keeps a memory pool: the process keeps its peak footprint.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from absl import logging

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1

_done = False


def keep_freed_memory() -> bool:
  """Makes glibc malloc keep freed memory for reuse (no mmap, no trimming).

  Idempotent. Returns whether the setting is in effect: False where the C
  library is not glibc (macOS, musl), which keeps its defaults.
  """
  global _done
  if _done:
    return True
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    logging.info("host: no glibc mallopt; host allocator left as is.")
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  # mallopt returns 1 on success.
  _done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
  logging.info("host: glibc malloc keeps freed memory for reuse: %s", _done)
  return _done
