"""Throughput accounting (MFU) and metric writers.

MFU uses model FLOPs per non-pad token (`ModelConfig.flops_per_token`, the
PaLM-paper convention: training = 3 x forward, padding not counted) times tokens
per second, over the peak FLOP/s of the devices. Peak FLOP/s is a table for accelerators and a same-run matmul
measurement on CPU, so a CPU "MFU" is a fraction of what this machine's own
matmul reaches.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import tensorboardX
from absl import logging

from lctx import hardware


def measure_matmul_flops(
  n: int = 2048, dtype=jnp.float32, repeats: int = 3, device: jax.Device | None = None
) -> float:
  """FLOP/s of one n^3 matmul on `device` (best of `repeats`)."""
  device = device or jax.local_devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n**3 / best


def peak_flops_per_device(device: jax.Device | None = None) -> tuple[float, str]:
  """(peak FLOP/s of one device, where the number came from).

  On CPU the "device" is one fake device of the host, and all fake devices
  share the same cores: the measured matmul rate is split evenly between them.
  """
  device = device or jax.local_devices()[0]
  acc = hardware.accelerator_of_device_kind(device.device_kind)
  if acc is not None:
    # Per device: a TPU7x chip's peak is shared by its two devices.
    flops = acc.peak_bf16_flops_per_chip / acc.devices_per_chip
    return flops, f"spec sheet ({device.device_kind}, lctx/hardware.py)"
  if device.platform == "cpu":
    rate = measure_matmul_flops(device=device)
    share = rate / jax.local_device_count()
    return share, (
      f"CPU 2048^3 matmul measured at start-up: {rate / 1e9:.1f} "
      f"GFLOP/s shared by {jax.local_device_count()} fake devices"
    )
  logging.warning("No peak FLOP/s known for %s; MFU is reported as 0.", device.device_kind)
  return 0.0, f"unknown device kind {device.device_kind!r}"


def compiled_memory(compiled) -> dict[str, int]:
  """Per-device bytes from XLA's compiled memory analysis."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return {}
  if m is None:
    return {}
  out = {}
  for key in (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
  ):
    if hasattr(m, key):
      out[key.replace("_size_in_bytes", "_bytes")] = int(getattr(m, key))
  return out


def live_memory() -> dict[str, int]:
  """Live memory stats of the first local device where the backend has them."""
  stats = jax.local_devices()[0].memory_stats()
  if not stats:
    return {}
  keep = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
  return {f"live_{k}": int(stats[k]) for k in keep if k in stats}


class MetricWriter:
  """Writes scalars to `<workdir>/metrics.jsonl` and TensorBoard.

  Only process 0 writes. One JSON object per call, with `step` first.
  """

  def __init__(self, workdir: str, enable_tensorboard: bool = True):
    self._active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    if not self._active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115 (closed in close())
    if enable_tensorboard:
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    if not self._active:
      return
    record = {"step": int(step)}
    record.update({k: _to_python(v) for k, v in scalars.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def _to_python(v):
  if hasattr(v, "item"):
    return v.item()
  return v


def check_profile_steps(profile_steps) -> None:
  """TrainConfig.profile_steps: None or (start, stop) with 0 <= start < stop."""
  if profile_steps is None:
    return
  ok = (
    isinstance(profile_steps, (tuple, list))
    and len(profile_steps) == 2
    and all(isinstance(s, int) for s in profile_steps)
    and 0 <= profile_steps[0] < profile_steps[1]
  )
  if not ok:
    raise ValueError(
      "TrainConfig.profile_steps must be None or (start, stop) with "
      f"0 <= start < stop; got {profile_steps!r}."
    )


class Profiler:
  """A jax.profiler trace of steps start+1 .. stop (`TrainConfig.profile_steps`).

  The trace lands under `directory` (TensorBoard's profile plugin reads it);
  every process traces its own devices. `profile_steps=None` does nothing.
  """

  def __init__(self, profile_steps: tuple[int, int] | None, directory: str):
    check_profile_steps(profile_steps)
    self._window, self._directory = profile_steps, directory
    self._active = self._done = False

  def before_step(self, step: int) -> None:
    """`step`: steps done before the one about to run."""
    if self._window is None or self._active or self._done:
      return
    start, stop = self._window
    if start <= step < stop:
      os.makedirs(self._directory, exist_ok=True)
      jax.profiler.start_trace(self._directory)
      self._active = True
      logging.info("Profiling steps %d..%d into %s", step + 1, stop, self._directory)

  def after_step(self, step: int, outputs: Any) -> None:
    if self._active and step >= self._window[1]:
      jax.block_until_ready(outputs)
      self.stop()

  def stop(self) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active, self._done = False, True
      logging.info("Profile written to %s", self._directory)
