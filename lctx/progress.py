"""A heartbeat on the absl log for long work that prints nothing meanwhile.

Full-size compiles take minutes (lowering, then the XLA compiler); without a
sign of life they look hung. `Heartbeat` logs the phase and the time elapsed
when a phase starts and every `every` seconds after, from a daemon thread:

    with progress.Heartbeat("compile v5p:4x4x4") as beat:
      lowered = f.lower(...)
      beat.phase("compiling")
      compiled = lowered.compile()
"""

from __future__ import annotations

import threading
import time

from absl import logging

EVERY_SECONDS = 20.0  # under the 30 s within which a long compile should show progress


class Heartbeat:
  """Logs `<what>: <phase>, <elapsed> s` every `every` seconds until exit."""

  def __init__(self, what: str, first_phase: str = "lowering", every: float = EVERY_SECONDS):
    self._what, self._phase, self._every = what, first_phase, every
    self._start = self._phase_start = time.perf_counter()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="lctx-heartbeat", daemon=True)

  def phase(self, name: str) -> None:
    """Starts phase `name` (logged at once, with how long the last one took)."""
    now = time.perf_counter()
    logging.info("%s: %s (%s took %.0f s)", self._what, name, self._phase, now - self._phase_start)
    self._phase, self._phase_start = name, now

  def _beat(self) -> None:
    while not self._stop.wait(self._every):
      logging.info(
        "%s: still %s, %.0f s elapsed", self._what, self._phase, time.perf_counter() - self._start
      )

  def __enter__(self) -> Heartbeat:
    logging.info("%s: %s", self._what, self._phase)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
