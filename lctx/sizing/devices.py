"""The environment the compile-only device libraries read when they load.

libtpu (TPU slices, lctx/sizing/tpu.py) and the CUDA plugin (GPU nodes,
lctx/sizing/gpu.py) read these variables once, when they load; this is the one
place lctx sets them. Scripts and tests that load libtpu at import time call
`compile_only_env()` before jax starts. The devices of a named topology are
`lctx.sizing.compile.compile_devices`.
"""

from __future__ import annotations

import os

COMPILE_ONLY_ENV = {
  # Other processes on this machine may hold libtpu too.
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  # There is no TPU metadata server to ask.
  "TPU_SKIP_MDS_QUERY": "1",
  # Without the metadata server libtpu finds no worker list and logs an E0000
  # error; compile-only devices live in this one process.
  "TPU_WORKER_HOSTNAMES": "localhost",
}
GPU_COMPILE_ONLY_ENV = {
  # Without a GPU the CUDA plugin's library version check fails and the plugin
  # is not registered (so no topology); read when jax discovers its plugins.
  "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
}


def compile_only_env(gpu: bool = False) -> None:
  """Sets COMPILE_ONLY_ENV (read when libtpu loads, at the first topology
  call), and with `gpu` GPU_COMPILE_ONLY_ENV (read when jax discovers its
  plugins); values already set are kept."""
  for name, value in {**COMPILE_ONLY_ENV, **(GPU_COMPILE_ONLY_ENV if gpu else {})}.items():
    os.environ.setdefault(name, value)
