"""Local text corpora: the embedded default (Python stdlib) and text-file globs.

The default corpus needs no download and exists on every machine: the standard
library's own `.py` sources (~1,800 files, ~30 MB, many of them 10-100 KB long)
plus the `pydoc_data.topics` help pages. Documents are yielded in a sorted,
machine-independent order with a stable key, so a split assignment by key hash
is the same everywhere.
"""

from __future__ import annotations

import glob as glob_lib
import hashlib
import os
import sysconfig
from collections.abc import Iterator

DEFAULT_CORPUS = "stdlib"


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _stdlib_files() -> list[str]:
  root = stdlib_dir()
  files = []
  for path in glob_lib.glob(os.path.join(root, "**", "*.py"), recursive=True):
    rel = os.path.relpath(path, root)
    # Third-party packages installed into the base interpreter are not stdlib.
    if "site-packages" in rel or "dist-packages" in rel:
      continue
    files.append(path)
  return sorted(files)


def expand_glob(pattern: str) -> list[str]:
  """A directory (all files under it, recursively) or a glob -> sorted files."""
  pattern = os.path.expanduser(pattern)
  if os.path.isdir(pattern):
    pattern = os.path.join(pattern, "**", "*")
  return sorted(p for p in glob_lib.glob(pattern, recursive=True) if os.path.isfile(p))


def corpus_fingerprint(text_glob: str | None) -> str:
  """Short hash of the glob, file list and sizes: the cache key of a prepared
  corpus, so editing or adding files prepares a fresh copy."""
  default = text_glob in (None, DEFAULT_CORPUS)
  files = _stdlib_files() if default else expand_glob(text_glob)
  h = hashlib.sha1(str(text_glob if not default else DEFAULT_CORPUS).encode())
  for f in files:
    h.update(f.encode())
    h.update(str(os.path.getsize(f)).encode())
  return h.hexdigest()[:12]


def list_documents(text_glob: str | None = None) -> list[str]:
  """Keys of every non-empty document, sorted: file paths, or for the default
  corpus stdlib-relative paths plus 'pydoc_data.topics/<name>'.

  Raises ValueError when nothing non-empty matches, naming what to pass instead.
  """
  if text_glob in (None, DEFAULT_CORPUS):
    root = stdlib_dir()
    keys = [os.path.relpath(f, root) for f in _stdlib_files() if os.path.getsize(f) > 0]
    import pydoc_data.topics  # pylint: disable=g-import-not-at-top

    keys += [
      f"{_TOPICS}/{name}"
      for name in sorted(pydoc_data.topics.topics)
      if pydoc_data.topics.topics[name]
    ]
  else:
    keys = [f for f in expand_glob(text_glob) if os.path.getsize(f) > 0]
  if not keys:
    raise ValueError(
      f"text corpus {text_glob!r} is missing or empty: no non-empty file "
      "matches it. Pass a directory or glob of text files (e.g. "
      "text_glob='/data/books/*.txt'), or text_glob='stdlib' for the "
      "embedded default corpus."
    )
  return keys


_TOPICS = "pydoc_data.topics"


def read_document(key: str, text_glob: str | None = None) -> bytes:
  """Raw bytes of one document (may be invalid UTF-8; kept exactly)."""
  if text_glob in (None, DEFAULT_CORPUS):
    if key.startswith(_TOPICS + "/"):
      import pydoc_data.topics  # pylint: disable=g-import-not-at-top

      return pydoc_data.topics.topics[key[len(_TOPICS) + 1 :]].encode("utf-8", "surrogatepass")
    key = os.path.join(stdlib_dir(), key)
  with open(key, "rb") as f:
    return f.read()


def iter_documents(text_glob: str | None = None) -> Iterator[tuple[str, bytes]]:
  """Yields (key, raw bytes) for every document of the corpus, in key order."""
  for key in list_documents(text_glob):
    yield key, read_document(key, text_glob)


def split_keys(keys: list[str], validation_fraction: float) -> tuple[list[str], list[str]]:
  """(train, validation) by a stable hash of each key.

  File paths are hashed relative to the corpus' common directory, so the same
  files give the same split wherever the corpus lives (a temp dir, another
  machine). With >= 2 documents and 0 < validation_fraction < 1 neither split is
  empty: tiny corpora in tests still get both.
  """
  names = _split_names(keys)
  val = [k for k, n in zip(keys, names) if is_validation(n, validation_fraction)]
  if len(keys) >= 2 and 0 < validation_fraction < 1:
    if not val:
      val = [keys[-1]]
    elif len(val) == len(keys):
      val = val[1:]
  val_set = set(val)
  train = [k for k in keys if k not in val_set]
  return train, val


def _split_names(keys: list[str]) -> list[str]:
  """What the split hashes: absolute paths relative to their common directory."""
  if len(keys) < 2 or not all(os.path.isabs(k) for k in keys):
    return list(keys)
  root = os.path.commonpath(keys)
  return [os.path.relpath(k, root) for k in keys]


def is_validation(key: str, validation_fraction: float) -> bool:
  """Stable split assignment: hash of the document key, not its position."""
  bucket = int(hashlib.md5(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
  return bucket < validation_fraction
