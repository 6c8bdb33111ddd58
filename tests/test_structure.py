"""Package structure: lctx's static import graph has no cycle, and the parallel
package stands below sizing, models and the trainer.

The graph is read from the sources with `ast` (nothing is imported). Every
`import` and `from ... import` counts, at module level and inside functions
alike: a function-level import that closes a cycle is still a cycle (it only
hides it from the import system until the function runs). An edge goes to the
module named (`from lctx.sizing import gpu` -> lctx.sizing.gpu; `from
lctx.parallel import context_attention` -> the package lctx.parallel, its
__init__); the parent packages Python also initialises on the way are not
counted as edges, since a package's own __init__ re-exporting its submodules
would otherwise make every submodule import a cycle.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# lctx.parallel is the mesh and the strategies; what sizes a run, the model and
# the trainer build on it, never the other way round (docs/contracts.md).
PARALLEL_MUST_NOT_IMPORT = ("lctx.sizing", "lctx.models", "lctx.train")


def _modules(root: str = ROOT) -> dict[str, str]:
  """Dotted module name -> path, for every .py file under root/lctx."""
  out = {}
  for d, _, files in os.walk(os.path.join(root, "lctx")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        name = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
  """lctx module -> the lctx modules it imports (module- and function-level)."""
  mods = _modules(root)

  def resolve(name: str) -> str | None:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for mod, path in mods.items():
    package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    edges = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        edges.update(resolve(a.name) for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          parts = parts[: len(parts) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for a in node.names:
          full = f"{base}.{a.name}"
          edges.add(full if full in mods else resolve(base))
    edges.discard(None)
    edges.discard(mod)
    graph[mod] = edges
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def _describe(graph, comp) -> str:
  return "; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(comp)))}" for a in comp)


def test_the_graph_reader_sees_module_and_function_level_imports_and_cycles(tmp_path):
  pkg = tmp_path / "lctx"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("from lctx.sub.b import thing\n")
  (pkg / "sub" / "a.py").write_text("from . import b\n")
  (pkg / "sub" / "b.py").write_text("def f():\n  from lctx.sub import a\n  import lctx.c\n")
  (pkg / "c.py").write_text("import os\nfrom lctx.sub import thing\n")
  graph = import_graph(str(tmp_path))
  assert graph["lctx.sub.a"] == {"lctx.sub.b"}  # relative, module level
  assert graph["lctx.sub.b"] == {"lctx.sub.a", "lctx.c"}  # function level
  assert graph["lctx.c"] == {"lctx.sub"}  # a name re-exported by a package
  assert graph["lctx.sub"] == {"lctx.sub.b"}
  assert cycles(graph) == [["lctx.c", "lctx.sub", "lctx.sub.a", "lctx.sub.b"]]
  assert cycles({"x": {"y"}, "y": set()}) == []


def test_no_module_of_lctx_imports_another_in_a_cycle():
  graph = import_graph()
  assert len(graph) > 50 and "lctx.sizing.compile" in graph
  found = cycles(graph)
  assert not found, "import cycles: " + " | ".join(_describe(graph, c) for c in found)


@pytest.mark.parametrize("forbidden", PARALLEL_MUST_NOT_IMPORT)
def test_parallel_imports_nothing_from_sizing_models_or_the_trainer(forbidden):
  graph = import_graph()
  bad = {
    mod: sorted(t for t in targets if t == forbidden or t.startswith(forbidden))
    for mod, targets in graph.items()
    if mod == "lctx.parallel" or mod.startswith("lctx.parallel.")
  }
  bad = {mod: targets for mod, targets in bad.items() if targets}
  assert not bad, f"lctx.parallel imports {forbidden}: {bad}"
