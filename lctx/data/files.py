"""Row files: .jsonl, .jsonl.gz and .parquet documents, one per row/line.

`iter_rows(kind, pattern, field)` yields (key, raw bytes) in a sorted,
machine-independent order; the key is '<file>:<line>' (jsonl, 1-based lines)
or '<file>:<row>' (parquet, 1-based rows). Bad input raises BadRowError, a
ValueError that names the file and the line or row: a line that is not JSON,
a row without the field (or with a null / non-text one), a truncated file.
Kind 'chat' reads .jsonl and .parquet files alike; each row becomes one
conversation (lctx.data.conversations.row_to_bytes checks its messages, so an unknown
role or a missing field names the row too). With `on_bad_row` given, the reader calls it with that error instead and goes
on (for a truncated file: with the next file).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator

from lctx.data import corpus
from lctx.errors import BadRowError  # noqa: F401  (re-exported)

ROW_KINDS = ("jsonl", "parquet", "chat")
_EXTENSIONS = {"jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz"), "parquet": (".parquet",)}
_EXTENSIONS["chat"] = _EXTENSIONS["jsonl"] + _EXTENSIONS["parquet"]
# A whole row (dict) -> the document's bytes, or BadRowError (kind 'chat').
Extract = Callable[[object, str], bytes]


def list_files(kind: str, pattern: str) -> list[str]:
  """Files of `kind` under a directory, glob or single path; ValueError if none."""
  files = corpus.expand_glob(pattern)
  if kind in _EXTENSIONS:
    files = [f for f in files if f.endswith(_EXTENSIONS[kind])]
  if not files:
    ext = ", ".join(_EXTENSIONS.get(kind, ("any",)))
    raise ValueError(
      f"{kind} source path {pattern!r} is missing or matches no {ext} file; pass a file, "
      "a directory or a glob that exists."
    )
  return files


def _as_bytes(value, where: str, field: str) -> bytes:
  if isinstance(value, str):
    return value.encode("utf-8", "surrogatepass")
  if isinstance(value, bytes):
    return value
  kind = "null" if value is None else type(value).__name__
  raise BadRowError(where, f"field {field!r} is {kind}, not text.")


def _jsonl_rows(path: str, field: str, extract: Extract | None) -> Iterator[tuple[str, bytes]]:
  opener = gzip.open if path.endswith(".gz") else open
  line_no = 0
  try:
    with opener(path, "rb") as f:
      for line_no, line in enumerate(f, start=1):
        if not line.strip():
          continue
        where = f"{path}:{line_no}"
        try:
          row = json.loads(line)
        except ValueError as e:
          yield where, BadRowError(where, f"line {line_no} is not JSON ({e}).")
          continue
        if extract is not None:
          try:
            yield where, extract(row, where)
          except BadRowError as e:
            yield where, e
          continue
        if not isinstance(row, dict) or field not in row:
          keys = sorted(row)[:10] if isinstance(row, dict) else type(row).__name__
          yield where, BadRowError(where, f"line {line_no} has no field {field!r} (it has {keys}).")
          continue
        try:
          yield where, _as_bytes(row[field], where, field)
        except BadRowError as e:
          yield where, e
  except (EOFError, OSError, zlib.error) as e:
    where = f"{path}:{line_no + 1}"
    yield (
      where,
      BadRowError(
        where, f"the file is truncated or corrupt after line {line_no} ({type(e).__name__}: {e})."
      ),
    )


def _parquet_rows(path: str, field: str, extract: Extract | None) -> Iterator[tuple[str, bytes]]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (only for parquet)

  try:
    reader = pq.ParquetFile(path)
  except Exception as e:  # pylint: disable=broad-except  (pyarrow raises several types)
    yield (
      path,
      BadRowError(
        path, f"not a readable parquet file (truncated or corrupt: {type(e).__name__}: {e})."
      ),
    )
    return
  if extract is not None:
    yield from _parquet_whole_rows(path, reader, extract)
    return
  if field not in reader.schema_arrow.names:
    yield (
      path,
      BadRowError(path, f"has no column {field!r} (it has {reader.schema_arrow.names[:10]})."),
    )
    return
  row = 0
  try:
    for group in range(reader.num_row_groups):
      for value in reader.read_row_group(group, columns=[field]).column(0).to_pylist():
        row += 1
        where = f"{path}:{row}"
        try:
          yield where, _as_bytes(value, where, field)
        except BadRowError as e:
          yield where, BadRowError(where, f"row {row}: {e.what}")
  except Exception as e:  # pylint: disable=broad-except
    where = f"{path}:{row + 1}"
    yield (
      where,
      BadRowError(
        where, f"cannot read past row {row} (truncated or corrupt: {type(e).__name__}: {e})."
      ),
    )


def _parquet_whole_rows(path: str, reader, extract: Extract) -> Iterator[tuple[str, bytes]]:
  row = 0
  try:
    for group in range(reader.num_row_groups):
      for value in reader.read_row_group(group).to_pylist():
        row += 1
        where = f"{path}:{row}"
        try:
          yield where, extract(value, where)
        except BadRowError as e:
          yield where, e
  except Exception as e:  # pylint: disable=broad-except
    where = f"{path}:{row + 1}"
    yield (
      where,
      BadRowError(
        where, f"cannot read past row {row} (truncated or corrupt: {type(e).__name__}: {e})."
      ),
    )


def iter_rows(
  kind: str,
  pattern: str,
  field: str,
  on_bad_row: Callable[[BadRowError], None] | None = None,
) -> Iterator[tuple[str, bytes]]:
  """(key, raw bytes) of every row of every file of `kind` matching `pattern`.

  For kind 'chat', `field` is the JSON of lctx.data.specs.chat_fields."""
  if kind not in ROW_KINDS:
    raise ValueError(f"row files are {ROW_KINDS}, not {kind!r}.")
  extract = None
  if kind == "chat":
    from lctx.data import conversations  # pylint: disable=g-import-not-at-top  (jinja2 lazily)

    fields = json.loads(field)
    extract = lambda row, where: conversations.row_to_bytes(row, where, fields)  # noqa: E731
  for path in list_files(kind, pattern):
    parquet = path.endswith(_EXTENSIONS["parquet"])
    read = _parquet_rows if parquet else _jsonl_rows
    for key, value in read(path, field, extract):
      if isinstance(value, BadRowError):
        if on_bad_row is None:
          raise BadRowError(
            value.where,
            value.what
            + " Fix or remove it, or set DataConfig.skip_bad_rows = True to skip bad rows.",
          )
        on_bad_row(value)
        continue
      yield key, value
