"""lctx.host: glibc keeps freed memory, so a re-allocation does not page-fault."""

import ctypes.util
import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, ctypes.util, resource, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
  from lctx import host
  assert host.keep_freed_memory() and host.keep_freed_memory()  # idempotent
def touch():  # what XLA does with a step's temporaries: malloc, write, free
  n = 64 * 2**20
  p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
touch()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _faults(mode):
  out = subprocess.run(
    [sys.executable, "-c", _PROBE, mode], check=True, capture_output=True, text=True
  )
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(
  not sys.platform.startswith("linux") or "libc.so" not in (ctypes.util.find_library("c") or ""),
  reason="glibc only",
)
def test_keep_freed_memory_stops_refaulting_large_buffers():
  default = _faults("default")
  if default < 4000:  # e.g. transparent huge pages: nothing to remove
    pytest.skip(f"default allocator faults only {default} times per 64 MiB")
  kept = _faults("keep")
  assert kept < default / 10, (kept, default)
