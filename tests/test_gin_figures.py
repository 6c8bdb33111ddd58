"""The compiled figures have one home (lctx/sizing/full_size_compiles.json); the
gin headers' `# Figures` line and README's table are written from it by
scripts/write_gin_figures.py. A header or table that disagrees with the records
is stale and fails here; the fix is to run the writer, not to edit the figure."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _writer():
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  try:
    return importlib.import_module("write_gin_figures")
  finally:
    sys.path.pop(0)


def _tree(tmp_path, gin_file="gin/ring_v5p.gin"):
  """A copy of the records, one gin file and README under tmp_path."""
  w = _writer()
  for rel in (w.RECORDS_FILE, gin_file, w.README):
    os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
    shutil.copy(os.path.join(ROOT, rel), tmp_path / rel)
  records = w.load_records(str(tmp_path))
  return w, {gin_file: records[gin_file]}


def test_the_repository_headers_and_readme_are_what_the_records_say():
  w = _writer()
  assert w.write(check=True) == [], "stale: run python scripts/write_gin_figures.py"
  for gin_file in w.load_records():
    with open(os.path.join(ROOT, gin_file)) as f:
      assert sum(line.startswith(w.PREFIX) for line in f) == 1, gin_file


def test_a_new_record_rewrites_the_one_figure_line_and_the_readme_row(tmp_path):
  w, records = _tree(tmp_path)
  gin = tmp_path / "gin/ring_v5p.gin"
  before = gin.read_text()
  assert w.write(root=str(tmp_path), records=records, check=True) == ["README.md"]  # 1 row now
  old = f"{records['gin/ring_v5p.gin']['total_gib']:.2f}"  # the recorded figure
  records["gin/ring_v5p.gin"] = dict(records["gin/ring_v5p.gin"], total_gib=40.125, hbm_gib=95.74)
  stale = w.write(root=str(tmp_path), records=records, check=True)
  assert stale == ["gin/ring_v5p.gin", "README.md"]
  assert gin.read_text() == before  # --check writes nothing
  assert w.write(root=str(tmp_path), records=records) == stale
  after = gin.read_text()
  changed = [(a, b) for a, b in zip(before.split("\n"), after.split("\n"), strict=True) if a != b]
  assert len(changed) == 1 and changed[0][1].startswith("# Figures")
  assert "40.12 GiB per device of 95.74" in changed[0][1]
  assert old in changed[0][0] and old not in after
  readme = (tmp_path / "README.md").read_text()
  assert "| `gin/ring_v5p.gin` | `v5p:4x4x4` (64 devices) |" in readme
  assert "40.12 GiB (of 95.74)" in readme and "gin/usp_ironwood.gin" not in readme
  assert w.write(root=str(tmp_path), records=records) == []  # now current


def test_a_header_without_a_figure_line_gets_one_at_its_end_and_two_are_refused():
  w = _writer()
  text = "# Title\n#\n# Launch:\n#   x\ninclude 'a.gin'\nX.y = 1\n"
  out = w.rewrite_header(text, "# Figures: 1", "t.gin")
  assert out == "# Title\n#\n# Launch:\n#   x\n# Figures: 1\ninclude 'a.gin'\nX.y = 1\n"
  assert w.rewrite_header(out, "# Figures: 2") == out.replace("# Figures: 1", "# Figures: 2")
  with pytest.raises(ValueError, match="t.gin: 2 '# Figures' header lines"):
    w.rewrite_header("# Figures: 1\n# Figures: 2\nX.y = 1\n", "# Figures: 3", "t.gin")


def test_figure_line_states_the_record():
  w = _writer()
  r = json.load(open(os.path.join(ROOT, w.RECORDS_FILE)))["gin/long_h100.gin"]
  line = w.figure_line(dict(r, total_gib=74.06, host_gib=144, step_seconds_estimate=30501))
  assert line.startswith("# Figures (--mode=compile --compile_topology=h100x8, ")
  assert "CUDA plugin" in line and "libtpu" not in line
  assert "74.06 GiB per device of 79.11 and 144 GiB of pinned host" in line
  assert "step ~8.5 h" in line
  assert "step ~451 s" in w.figure_line(dict(r, step_seconds_estimate=451))


def test_a_record_judged_by_its_allocation_shows_it_with_memory_analysis_beside():
  w = _writer()
  r = json.load(open(os.path.join(ROOT, w.RECORDS_FILE)))["gin/ring_v5p.gin"]
  judged = dict(r, allocated_gib=81.5, total_gib=104.25)
  line = w.figure_line(judged)
  assert "81.50 GiB of HBM allocated per device of 95.74 (memory_analysis 104.25)" in line
  row = w.readme_table({"gin/ring_v5p.gin": judged}).split("\n")[-1]
  assert "| 81.50 GiB allocated (of 95.74; memory_analysis 104.25) |" in row
  for old in (r, dict(r, allocated_gib=None)):  # records from before carry the total alone
    assert f"| {r['total_gib']:.2f} GiB (of 95.74) |" in w.readme_table({"g": old})
