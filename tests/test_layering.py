"""estimator's predict path imports neither torch, hydra, numpy nor sklearn; calibrate/harness don't mix."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_predict_path_is_pure_python():
    code = ("import sys, estimator; from estimator.api import estimate; from estimator.spec import RunSpec;"
            "estimate(RunSpec(model='facebook/opt-125m'));"
            "bad = [m for m in ('torch', 'transformers', 'hydra', 'numpy', 'sklearn', 'pandas') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_harness_and_calibrate_never_import_each_other():
    for package, forbidden in (("harness", "calibrate"), ("calibrate", "harness"), ("estimator", "harness"),
                               ("estimator", "calibrate")):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert not re.search(rf"^\s*(from|import) {forbidden}\b", text, re.M), f"{path} imports {forbidden}"


def _estimator_imports() -> dict[str, set[str]]:
    """Each estimator module -> the estimator modules it imports, at the top or inside a function."""
    import ast

    modules = {}
    for path in (ROOT / "estimator").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("estimator"):
                for alias in node.names:  # `from estimator.pkg import module` names a module too
                    child = f"{node.module}.{alias.name}"
                    found.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("estimator"))
        graph[name] = {m for m in found if m in modules and m != name and m != "estimator"}
    return graph


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_estimator_modules_import_each_other_in_one_direction():
    _assert_acyclic(_estimator_imports())


def _concern(module: str) -> str:
    """``estimator.reserved.zero3`` -> ``reserved``; a top-level module (``api``, ``spec``) is its own concern."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_estimator_subpackages_import_each_other_in_one_direction():
    """One level up: no subpackage imports one that imports it back through other modules (docs/DESIGN.md's
    layering), so each concern can be read, tested and moved with what is below it."""
    concerns: dict[str, set[str]] = {}
    for module, imported in _estimator_imports().items():
        concerns.setdefault(_concern(module), set()).update(
            _concern(m) for m in imported if _concern(m) != _concern(module))
    _assert_acyclic(concerns)


def test_estimator_top_level_stays_small():
    """Concerns live in subpackages (models, methods, hardware, planning, baselines, io, ...); the top level holds
    the entry points and the shared contracts only."""
    top = sorted(p.name for p in (ROOT / "estimator").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "columns.py", "spec.py"], top
