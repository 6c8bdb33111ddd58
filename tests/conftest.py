"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8"
  # A loaded CI machine must not turn a slow fake device into a killed process
  # (lctx/platforms.py, CPU_COLLECTIVE_TIMEOUT_FLAG).
  + " --xla_cpu_collective_call_terminate_timeout_seconds=1200"
  # The suite's programs are tiny and mostly compiled once: code generated at a
  # lower LLVM optimisation level compiles faster than optimised code would run
  # faster (two compile-heavy hybrid tests alone: 75-82 -> 65-66 s on 2 cores;
  # docs/benchmarks.md, "The test suite's time"). Every tolerance is unchanged.
  + " --xla_backend_optimization_level=0"
  + " --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Test files the two workers start first, heaviest first: their worker-seconds in a
# default run with --durations=0 on 2 cores (2026-12-06), 248 s down to 85 s.
# pytest-xdist's own order (most tests first) started the files of a few long tests
# last, so one worker ran alone at the end. Files not named here follow in
# collection order. The order changes only when a test runs, never its result.
HEAVY_FIRST = (
  "test_strategies_hybrid.py",
  "test_gin_configs.py",
  "test_kernels_splash.py",
  "test_context_strategies.py",
  "test_models.py",
  "test_planner.py",
  "test_compile.py",  # 236 -> 139 s alone on 2026-12-07 (docs/benchmarks.md)
  "test_remat.py",
  "test_main_cli.py",
  "test_kernels_delta_rule.py",
  "test_train.py",
  "test_fault_tolerance.py",
  "test_sizing_linear.py",
  "test_upipe.py",
  "test_linear_context.py",
)


def pytest_collection_modifyitems(config, items):
  del config
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
