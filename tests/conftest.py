"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
  # A loaded CI machine must not turn a slow fake device into a killed process
  # (lctx/platforms.py, CPU_COLLECTIVE_TIMEOUT_FLAG).
  + " --xla_cpu_collective_call_terminate_timeout_seconds=1200"
  # The suite's programs are tiny and mostly compiled once: a cheaper LLVM backend
  # compiles them faster than the optimised code would run them faster (a hybrid
  # chunked-MLP test: 37 -> 24 s on 2 cores). XLA's HLO passes are the same; only
  # LLVM's optimisation of the machine code is cut. Every tolerance is unchanged.
  + " --xla_backend_optimization_level=0"
  + " --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
