"""scripts/peak_buffers.py reads XLA's buffer-assignment and live-range dumps and
lists the slots live where the temporary heap is fullest (the CPU compiler
writes the same dumps as the TPU one)."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "peak_buffers.py")


@functools.cache  # once: the script defines absl flags
def _script():
  spec = importlib.util.spec_from_file_location("peak_buffers", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_peak_lists_the_values_live_together(tmp_path):
  # Two f32 [512, 512] (1 MiB) products live at once (both feed the last
  # matmul), then a small result: the peak holds both, each counted once.
  def f(x, y):
    a = jnp.sin(x @ y)
    b = jnp.cos(y @ x)
    return (a @ b).sum()

  x = jnp.ones((512, 512), jnp.float32)
  opts = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "^$"}
  compiled = jax.jit(f).lower(x, x).compile(compiler_options=opts)
  temp = compiled.memory_analysis().temp_size_in_bytes
  got = _script().peak(str(tmp_path), program="jit_f")
  assert got["heap_bytes"] == temp
  assert got["live_bytes"] <= got["heap_bytes"]
  big = [s for s in got["slots"] if s[0] >= 2**20]
  assert len(big) >= 2, got["slots"][:4]
  assert all(s[1].startswith("f32[512,512]") for s in big)
  assert sum(s[0] for s in got["slots"]) == got["live_bytes"]  # distinct slots


def test_missing_dump_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match=r"no \*train_step\*buffer-assignment.txt"):
    _script().peak(str(tmp_path))
