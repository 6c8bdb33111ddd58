"""Builds, caches and registers the fused CPU attention kernel (cpu_attention.cc).

The kernel is compiled on first use with the host's C++ compiler (`$CXX`, else
g++ or c++) against the XLA FFI headers that ship with jaxlib, with
`-march=native`, and cached under `$LCTX_KERNEL_CACHE` (default
`~/.cache/lctx/kernels`), keyed by the source, jaxlib version, compiler and host
CPU. `LCTX_DISABLE_CPU_KERNEL=1` turns it off. The JAX binding is cpu_fused.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

_SOURCE = Path(__file__).with_name("cpu_attention.cc")
FWD_TARGET, BWD_TARGET = "lctx_cpu_attention_fwd", "lctx_cpu_attention_bwd"


def compiler() -> str | None:
  for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cpu_id() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return line
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _cache_dir() -> Path:
  return Path(os.environ.get("LCTX_KERNEL_CACHE", Path.home() / ".cache" / "lctx" / "kernels"))


def _build() -> Path:
  """Compiles (or finds cached) the shared library; raises RuntimeError why not."""
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler found (set $CXX, or install g++)")
  include = jax.ffi.include_dir()
  flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]
  key = hashlib.sha256()
  for part in (
    _SOURCE.read_bytes(),
    (Path(include) / "xla/ffi/api/ffi.h").read_bytes(),
    jax.__version__.encode(),
    cxx.encode(),
    " ".join(flags).encode(),
    _cpu_id().encode(),
  ):
    key.update(part)
  out = _cache_dir() / f"cpu_attention-{key.hexdigest()[:16]}.so"
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: concurrent builders never see half a file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  os.close(fd)
  cmd = [cxx, *flags, f"-I{include}", str(_SOURCE), "-o", tmp]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    os.unlink(tmp)
    raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-2000:]}")
  os.replace(tmp, out)
  return out


@functools.cache
def load() -> tuple[bool, str]:
  """(available, reason). Registers the FFI targets once per process."""
  if os.environ.get("LCTX_DISABLE_CPU_KERNEL"):
    return False, "disabled by LCTX_DISABLE_CPU_KERNEL"
  try:
    lib = ctypes.cdll.LoadLibrary(str(_build()))
  except (RuntimeError, OSError) as e:
    return False, str(e)
  jax.ffi.register_ffi_target(
    FWD_TARGET, jax.ffi.pycapsule(lib.LctxCpuAttentionForward), platform="cpu"
  )
  jax.ffi.register_ffi_target(
    BWD_TARGET, jax.ffi.pycapsule(lib.LctxCpuAttentionBackward), platform="cpu"
  )
  return True, ""


def available() -> bool:
  """True when the fused kernel is built and registered (compiles on first call)."""
  return load()[0]


def unavailable_reason() -> str:
  return load()[1]
