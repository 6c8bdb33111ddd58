"""Gin parsing helpers for main.py (kept free of jax imports).

`local_devices_macro` reads the `LOCAL_DEVICES = N` macro from gin files by
text, before jax is imported, because the number of fake CPU devices must be
in XLA_FLAGS before the first `import jax`.
"""

from __future__ import annotations

import difflib
import glob
import os
import re
from collections.abc import Sequence

from lctx.errors import ConfigError

_INCLUDE = re.compile(r"^\s*include\s+['\"]([^'\"]+)['\"]", re.M)
_LOCAL_DEVICES = re.compile(r"^\s*LOCAL_DEVICES\s*=\s*(\d+)\s*$", re.M)


def find_gin_file(name: str, search_paths: Sequence[str]) -> str:
  if os.path.isabs(name) or os.path.exists(name):
    return name
  for root in search_paths:
    candidate = os.path.join(root, name)
    if os.path.exists(candidate):
      return candidate
  known = sorted(
    {
      os.path.relpath(p, root)
      for root in search_paths
      for p in glob.glob(os.path.join(root, "gin", "**", "*.gin"), recursive=True)
    }
  )
  close = difflib.get_close_matches(name, known, n=1)
  raise ConfigError(
    f"gin file {name!r} not found in the working directory or in {list(search_paths)}.",
    fix=f"Did you mean {close[0]}?" if close else "The experiment files are gin/*.gin.",
  )


def local_devices_macro(
  files: Sequence[str], search_paths: Sequence[str], params: Sequence[str] = ()
) -> int | None:
  """The last `LOCAL_DEVICES = N` in `files` (includes first), or None."""
  found = None
  for param in params:
    m = _LOCAL_DEVICES.search(param)
    if m:
      found = int(m.group(1))

  def visit(path, depth=0):
    nonlocal found
    if depth > 20:
      return
    with open(find_gin_file(path, search_paths)) as f:
      text = f.read()
    for inc in _INCLUDE.findall(text):
      visit(inc, depth + 1)
    for m in _LOCAL_DEVICES.finditer(text):
      found = int(m.group(1))

  from_params = found
  for f in files:
    visit(f)
  return from_params if from_params is not None else found


def parse(files: Sequence[str], params: Sequence[str], search_paths: Sequence[str]) -> None:
  """Parses gin files and bindings; unknown configurables are errors."""
  import gin  # pylint: disable=g-import-not-at-top

  for root in search_paths:
    gin.add_config_file_search_path(root)
  resolved = [find_gin_file(f, search_paths) for f in files]
  gin.parse_config_files_and_bindings(resolved, params, skip_unknown=False, finalize_config=True)
