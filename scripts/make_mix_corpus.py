"""Writes a small ProLong-shaped corpus from local files, for gin/runs/long_mix.gin,
the tests and examples (no download: the Python standard library and pydoc_data).

    python scripts/make_mix_corpus.py --out=/tmp/lctx_mix [--max_docs=0]

Four domains, one per reader kind:
  code/*.jsonl.gz   'content': one row per stdlib package (a "repository": its
                    .py files joined, each under a '# file: <path>' line); long:
                    packages under MIN_REPOSITORY_CHARS (__phello__, a 253-byte
                    demo, on CPython 3.11) are left out, so every repository is
                    longer than a training window on every interpreter.
  books/*.txt       one file per "book": 30 pydoc help topics in a seeded order; long.
  arxiv/*.parquet   'text': one row per module, its docstrings (module, classes,
                    functions) as a "paper"; medium.
  short/*.jsonl     'text': one row per pydoc topic; short, high quality.
--max_docs caps the documents per domain (0 = all). Prints what it wrote.
"""

import argparse
import ast
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lctx.data import corpus  # noqa: E402


def _modules() -> list[str]:
  return [
    os.path.join(corpus.stdlib_dir(), k) for k in corpus.list_documents() if k.endswith(".py")
  ]


def _read(path: str) -> str:
  with open(path, "rb") as f:
    return f.read().decode("utf-8", "replace")


MIN_REPOSITORY_CHARS = 16384


def code_repositories(max_docs: int) -> list[str]:
  root = corpus.stdlib_dir()
  packages: dict[str, list[str]] = {}
  for path in _modules():
    rel = os.path.relpath(path, root)
    if os.sep in rel:
      packages.setdefault(rel.split(os.sep)[0], []).append(path)
  docs = []
  for name in sorted(packages):
    parts = [f"# file: {os.path.relpath(p, root)}\n{_read(p)}" for p in sorted(packages[name])]
    doc = "\n".join(parts)
    if len(doc) >= MIN_REPOSITORY_CHARS:
      docs.append(doc)
  return docs[: max_docs or None]


def _topics() -> list[tuple[str, str]]:
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top

  return [(k, v) for k, v in sorted(pydoc_data.topics.topics.items()) if v.strip()]


def books(max_docs: int, num_books: int = 24, chapters: int = 30) -> list[str]:
  """Book i: `chapters` help topics in a seeded order of its own (topics recur
  across books; the stdlib holds no long prose)."""
  import random  # pylint: disable=g-import-not-at-top

  topics = _topics()
  docs = []
  for i in range(min(max_docs or num_books, num_books)):
    picks = random.Random(i).sample(topics, min(chapters, len(topics)))
    docs.append(f"Book {i}\n\n" + "\n\n".join(f"Chapter: {k}\n\n{v}" for k, v in picks))
  return docs


def papers(max_docs: int) -> list[str]:
  docs = []
  for path in _modules():
    try:
      tree = ast.parse(_read(path))
    except (SyntaxError, ValueError):
      continue  # a few stdlib test files are not valid Python on purpose
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    parts = [ast.get_docstring(n) for n in nodes]
    text = "\n\n".join(p for p in parts if p)
    if len(text) > 200:
      docs.append(f"Abstract ({os.path.basename(path)}).\n\n{text}")
    if max_docs and len(docs) >= max_docs:
      break
  return docs


def short_texts(max_docs: int) -> list[str]:
  return [f"{k}\n\n{v}" for k, v in _topics()][: max_docs or None]


def write(out: str, max_docs: int = 0) -> dict[str, dict]:
  """Writes the four domains under `out`; returns {domain: {path, documents, bytes}}."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  summary = {}
  for sub in ("code", "books", "arxiv", "short"):
    os.makedirs(os.path.join(out, sub), exist_ok=True)
  code = code_repositories(max_docs)
  path = os.path.join(out, "code", "repos.jsonl.gz")
  with gzip.open(path, "wt", encoding="utf-8") as f:
    for doc in code:
      f.write(json.dumps({"content": doc}) + "\n")
  summary["code"] = (path, code)
  book_docs = books(max_docs)
  for i, doc in enumerate(book_docs):
    with open(os.path.join(out, "books", f"book_{i:03d}.txt"), "w", encoding="utf-8") as f:
      f.write(doc)
  summary["books"] = (os.path.join(out, "books"), book_docs)
  paper_docs = papers(max_docs)
  path = os.path.join(out, "arxiv", "papers.parquet")
  pq.write_table(pa.table({"text": paper_docs}), path, row_group_size=256)
  summary["arxiv"] = (path, paper_docs)
  short = short_texts(max_docs)
  path = os.path.join(out, "short", "topics.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for doc in short:
      f.write(json.dumps({"text": doc}) + "\n")
  summary["short"] = (path, short)
  return {
    k: dict(path=p, documents=len(d), bytes=sum(len(x.encode()) for x in d))
    for k, (p, d) in summary.items()
  }


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--out", default="/tmp/lctx_mix")
  p.add_argument("--max_docs", type=int, default=0)
  args = p.parse_args(argv)
  for domain, info in write(args.out, args.max_docs).items():
    print(
      f"{domain:>6}: {info['documents']:>5} documents, {info['bytes'] / 1e6:7.2f} MB  {info['path']}"
    )


if __name__ == "__main__":
  main()
