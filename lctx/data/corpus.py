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
from typing import Iterator

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
  return sorted(p for p in glob_lib.glob(pattern, recursive=True)
                if os.path.isfile(p))


def corpus_fingerprint(text_glob: str | None) -> str:
  """Short hash of the file list + sizes: the cache key of a prepared corpus."""
  files = _stdlib_files() if text_glob in (None, DEFAULT_CORPUS) else expand_glob(text_glob)
  h = hashlib.sha1()
  for f in files:
    h.update(f.encode())
    h.update(str(os.path.getsize(f)).encode())
  return h.hexdigest()[:12]


def iter_documents(text_glob: str | None = None) -> Iterator[tuple[str, bytes]]:
  """Yields (key, raw bytes) for every document of the corpus.

  text_glob None or 'stdlib' means the default corpus. Raw bytes, not str:
  files may hold invalid UTF-8 and the byte tokenizer keeps them exactly.
  Raises ValueError when the glob matches no non-empty file.
  """
  default = text_glob in (None, DEFAULT_CORPUS)
  files = _stdlib_files() if default else expand_glob(text_glob)
  count = 0
  for path in files:
    with open(path, "rb") as f:
      data = f.read()
    if data:
      count += 1
      yield os.path.relpath(path, stdlib_dir()) if default else path, data
  if default:
    import pydoc_data.topics  # pylint: disable=g-import-not-at-top
    for name in sorted(pydoc_data.topics.topics):
      text = pydoc_data.topics.topics[name]
      if text:
        count += 1
        yield f"pydoc_data.topics/{name}", text.encode("utf-8", "surrogatepass")
  if count == 0:
    raise ValueError(
        f"text corpus {text_glob!r} is missing or empty: no non-empty file "
        "matches it. Pass a directory or glob of text files (e.g. "
        "text_glob='/data/books/*.txt'), or text_glob='stdlib' for the "
        "embedded default corpus.")


def is_validation(key: str, validation_fraction: float) -> bool:
  """Stable split assignment: hash of the document key, not its position."""
  bucket = int(hashlib.md5(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
  return bucket < validation_fraction
