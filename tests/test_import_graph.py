"""The package's import graph: no circles, and nothing imported from the repository around it.

Edges are read from the source (ast), function-local imports included: a lazy import that only
hides a circle (data/cifar.py <-> data/sources.py once) still ties the two rooms together.
"""
import ast
import importlib
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "span_lm"


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(REPO).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


MODULES = _modules()


def _imported_names(name: str, path: pathlib.Path) -> list[str]:
  """Absolute dotted names `name`'s source imports (`from a import b` gives a.b when that is a
  module of the package, else a)."""
  names = []
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the package, level - 1 folders up
        up = package[:len(package) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      names += [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
  return names


def _graph() -> dict[str, set[str]]:
  graph = {}
  for name, path in MODULES.items():
    graph[name] = set()
    for target in _imported_names(name, path):
      while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
      if target in MODULES and target != name:
        graph[name].add(target)
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_cycle_finder_finds_a_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert _cycles(graph) == [["a", "b", "c"]]
  assert not _cycles({"a": {"b"}, "b": set()})


def test_no_import_cycles():
  graph = _graph()
  assert "span_lm.model.config" in graph["span_lm.config"]  # the graph sees imports at all
  assert _cycles(graph) == []


def test_run_config_imports_nothing_above_it():
  """span_lm/config.py (the schema and validate) sits below the trainer and the tools: it checks
  the sections with span_lm/run_config.py, which train/optimizer.py imports too, and reaches
  nothing in span_lm/train, span_lm/tools or span_lm/cli, directly or through another module."""
  graph = _graph()
  assert "span_lm.run_config" in graph["span_lm.config"]
  assert "span_lm.run_config" in graph["span_lm.train.optimizer"]
  reached, todo = set(), ["span_lm.config"]
  while todo:
    for target in graph[todo.pop()] - reached:
      reached.add(target)
      todo.append(target)
  above = sorted(n for n in reached if n.split(".")[:2] in (
      ["span_lm", "train"], ["span_lm", "tools"], ["span_lm", "cli"]))
  assert not above, f"span_lm.config reaches {above}"


def test_trainer_imports_nothing_above_it():
  """span_lm/train sits below the tools and the CLI: the hardware facts MFU and the OOM message
  read are kernels/chips.py, the FLOPs and memory counts model/costs.py, an export's reader
  train/from_export.py. No module under span_lm/train reaches span_lm/tools or span_lm/cli,
  directly or through another module (lazy imports included)."""
  graph = _graph()
  assert "span_lm.kernels.chips" in graph["span_lm.train.telemetry"]
  assert "span_lm.model.costs" in graph["span_lm.train.telemetry"]
  assert "span_lm.train.from_export" in graph["span_lm.train.loop"]  # a lazy import
  for name in sorted(n for n in graph if n.split(".")[:2] == ["span_lm", "train"]):
    reached, todo = set(), [name]
    while todo:
      for target in graph[todo.pop()] - reached:
        reached.add(target)
        todo.append(target)
    above = sorted(n for n in reached if n.split(".")[:2] in (
        ["span_lm", "tools"], ["span_lm", "cli"]))
    assert not above, f"{name} reaches {above}"


def test_kernels_import_nothing_from_the_model():
  """span_lm/kernels holds the implementations' names and fit rules; the model's config imports
  them from there, never the other way round."""
  graph = _graph()
  assert "span_lm.kernels" in graph["span_lm.model.config"]
  for name in sorted(n for n in graph if n.split(".")[:2] == ["span_lm", "kernels"]):
    bad = sorted(t for t in graph[name] if t.split(".")[:2] == ["span_lm", "model"])
    assert not bad, f"{name} imports {bad}"


def _family(name: str) -> str:
  """A kernel module's family: 'span' (kernels/span, and the package itself, which re-exports
  the span door), 'sparse' (kernels/sparse), or '' for what both share (kernels/*.py)."""
  parts = name.split(".")
  if parts == ["span_lm", "kernels"]:
    return "span"
  return parts[2] if len(parts) > 3 or parts[2:] in (["span"], ["sparse"]) else ""


def test_kernel_families_import_only_what_they_share():
  """One folder per kernel family: kernels/span and kernels/sparse never import each other, and
  the modules both share (kernels/*.py: target, chips, matmuls, pallas_common, ...) import
  neither."""
  graph = _graph()
  kernels = {n for n in graph if n.split(".")[:2] == ["span_lm", "kernels"]}
  assert {"span_lm.kernels.span.door", "span_lm.kernels.sparse.door"} <= kernels
  assert "span_lm.kernels.pallas_common" in graph["span_lm.kernels.sparse.pallas_gpu_sparse"]
  assert "span_lm.kernels.pallas_common" in graph["span_lm.kernels.span.pallas_gpu"]
  for name in sorted(kernels - {"span_lm.kernels"}):
    own = _family(name)
    bad = sorted(t for t in graph[name] & kernels if _family(t) not in ("", own))
    assert not bad, f"{name} ({own or 'shared'}) imports {bad}"


def test_package_imports_nothing_from_the_repository_around_it():
  """An installed span_lm has no configs/, bench/ or tests/ beside it."""
  around = {p.stem for p in REPO.iterdir()
            if p.name != "span_lm" and (p.suffix == ".py" or (p / "__init__.py").is_file()
                                        or p.name in ("configs", "bench", "tests"))}
  assert {"configs", "bench", "tests", "main"} <= around
  for name, path in MODULES.items():
    bad = sorted({n for n in _imported_names(name, path) if n.split(".")[0] in around})
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
  try:
    importlib.import_module(name)
  except ModuleNotFoundError as e:  # an optional dependency (tensorflow_datasets), not ours
    if e.name is None or e.name.split(".")[0] == "span_lm":
      raise
    pytest.skip(f"optional dependency {e.name} is not installed")
