r"""Writes the current compiled figures from their one home into the places that show them.

The home is lctx/sizing/full_size_compiles.json: one record per gin file, from
that file's `--mode=compile` compile.json, written by
`scripts/fit_memory_model.py --record=GIN_FILE=WORKDIR` (which runs this writer
for the file it records). From it this script writes
  - each recorded gin file's one `# Figures ...` header line (inserted at the end
    of the header when the file has none);
  - README.md's flagship table, between its `figures:start` / `figures:end`
    markers.
The history of earlier passes is docs/benchmarks.md, written by hand.

  python scripts/write_gin_figures.py           # rewrite the stale places
  python scripts/write_gin_figures.py --check   # exit 1 naming the stale ones
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS_FILE = os.path.join("lctx", "sizing", "full_size_compiles.json")
README = "README.md"
PREFIX = "# Figures"
TABLE_START = "<!-- figures:start (scripts/write_gin_figures.py writes this table) -->"
TABLE_END = "<!-- figures:end -->"


def load_records(root: str = ROOT) -> dict[str, dict]:
  with open(os.path.join(root, RECORDS_FILE)) as f:
    return json.load(f)


def _step(seconds: float) -> str:
  return f"~{seconds / 3600:.1f} h" if seconds >= 3600 else f"~{seconds:,.0f} s"


def _sci(x: float) -> str:
  return f"{x:.2e}".replace("e+", "e")


def _compiler(r: dict) -> str:
  if ":" in r["topology"]:
    return f"jax {r['jax_version']}, libtpu {r['libtpu_version']}"
  return f"jax {r['jax_version']}, the CUDA plugin's compile-only devices"


def figure_line(r: dict) -> str:
  """The one header line of a record's current figures."""
  if r.get("allocated_gib") is not None:  # fits judged by the compiler's check
    memory = (
      f"{r['allocated_gib']:.2f} GiB of HBM allocated per device of {r['hbm_gib']:.2f} "
      f"(memory_analysis {r['total_gib']:.2f})"
    )
  else:
    memory = f"{r['total_gib']:.2f} GiB per device of {r['hbm_gib']:.2f}"
  if r.get("host_gib"):
    memory += f" and {r['host_gib']:,.0f} GiB of pinned host"
  return (
    f"{PREFIX} (--mode=compile --compile_topology={r['topology']}, {r['date']}, "
    f"{_compiler(r)}; scripts/write_gin_figures.py; history: docs/benchmarks.md): "
    f"{memory}; {r['kernel']}; {_sci(r['total_flops'])} FLOPs per device per step, "
    f"{r['recompute_ratio']:.2f}x the model's; step {_step(r['step_seconds_estimate'])} "
    "(an estimate at 50% of bf16 peak)."
  )


def rewrite_header(text: str, line: str, name: str = "gin file") -> str:
  """`text` with its header's one `# Figures` line replaced by `line` (or
  `line` appended to the header, the leading block of comment lines)."""
  lines = text.split("\n")
  end = next((i for i, s in enumerate(lines) if not s.startswith("#")), len(lines))
  at = [i for i in range(end) if lines[i].startswith(PREFIX)]
  if len(at) > 1:
    raise ValueError(f"{name}: {len(at)} '{PREFIX}' header lines; a header holds one")
  if at:
    lines[at[0]] = line
  else:
    lines.insert(end, line)
  return "\n".join(lines)


def _per_device(r: dict) -> str:
  """The table's memory cell: the figure `fits` was judged by. Records since
  2026-12-07 carry the buffer assignment's HBM allocation (the compiler's own
  check), shown with memory_analysis' total beside it; older ones memory_analysis'
  total alone (at least the allocation)."""
  if r.get("allocated_gib") is not None:
    return (
      f"{r['allocated_gib']:.2f} GiB allocated (of {r['hbm_gib']:.2f}; "
      f"memory_analysis {r['total_gib']:.2f})"
    )
  return f"{r['total_gib']:.2f} GiB (of {r['hbm_gib']:.2f})"


def readme_table(records: dict[str, dict]) -> str:
  rows = [
    "| gin file | target | tokens per step | strategy | kernel | per device (of HBM) "
    "| step, estimated |",
    "|---|---|---|---|---|---|---|",
  ]
  for gin_file, r in records.items():
    where = (
      f"`{r['topology']}` ({r['devices']} devices)"
      if ":" in r["topology"]
      else f"`{r['topology']}` (compile-only GPU)"
    )
    rows.append(
      f"| `{gin_file}` | {where} | {r['tokens_per_step']:,} | {r['strategy']} | {r['kernel']} "
      f"| {_per_device(r)} | {_step(r['step_seconds_estimate'])} |"
    )
  return "\n".join(rows)


def rewrite_readme(text: str, records: dict[str, dict]) -> str:
  if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
    raise ValueError(f"{README}: needs one '{TABLE_START}' and one '{TABLE_END}' line")
  head, rest = text.split(TABLE_START)
  _, tail = rest.split(TABLE_END)
  return f"{head}{TABLE_START}\n{readme_table(records)}\n{TABLE_END}{tail}"


def write(
  gin_files=None, *, root: str = ROOT, records: dict | None = None, check: bool = False
) -> list[str]:
  """Rewrites the figures of `gin_files` (default: every recorded one) and the
  README table from `records` (default: the records file under `root`).
  Returns the files that were stale; with `check`, writes nothing."""
  records = load_records(root) if records is None else records
  changed = {}  # every new text is made before any file is written
  for name in [*(records if gin_files is None else gin_files), README]:
    with open(os.path.join(root, name)) as f:
      old = f.read()
    if name == README:
      new = rewrite_readme(old, records)
    elif name not in records:
      raise ValueError(f"{name}: no record in {RECORDS_FILE}")
    else:
      new = rewrite_header(old, figure_line(records[name]), name)
    if new != old:
      changed[name] = new
  if not check:
    for name, new in changed.items():
      with open(os.path.join(root, name), "w") as f:
        f.write(new)
  return list(changed)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
  args = ap.parse_args(argv)
  stale = write(check=args.check)
  for name in stale:
    print(f"{'stale' if args.check else 'wrote'}: {name}")
  return 1 if args.check and stale else 0


if __name__ == "__main__":
  sys.exit(main())
