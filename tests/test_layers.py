"""The three floors import only downward: core <- drafters <- apps; every module is imported by a test."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted((ROOT / "specviz" / "core").glob("*.py"))
DRAFTERS = sorted((ROOT / "drafters").rglob("*.py"))
APPS = sorted((ROOT / "specviz" / "apps").rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def loaded_after(modules: list[str]) -> list[str]:
    """The modules a fresh interpreter holds after importing ``modules``."""
    code = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def imported_names(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_the_core_loads_no_drafter_and_no_app():
    loaded = loaded_after([module_name(p) for p in CORE])
    assert not [m for m in loaded if m == "drafters" or m.startswith(("drafters.", "specviz.apps"))]
    assert "gradio" not in loaded and "plotly" not in loaded
    assert not [m for m in loaded if m.startswith("transformers.models.")]  # no model family is needed


def test_the_drafters_load_no_app():
    loaded = loaded_after([module_name(p) for p in DRAFTERS])
    assert not [m for m in loaded if m.startswith("specviz.apps")]
    assert "gradio" not in loaded


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_no_core_module_names_an_upper_floor(path):
    assert not [n for n in imported_names(path) if n.startswith(("drafters", "specviz.apps"))]


@pytest.mark.parametrize("path", DRAFTERS, ids=lambda p: p.name)
def test_no_drafter_module_names_an_app(path):
    assert not [n for n in imported_names(path) if n.startswith("specviz.apps")]


def test_every_module_is_imported_by_a_test():
    tests = set()
    for path in (ROOT / "tests").glob("*.py"):
        tests |= imported_names(path)
    modules = [module_name(p) for p in CORE + DRAFTERS + APPS if p.name != "__init__.py"]
    assert [m for m in modules if not any(n == m or n.startswith(m + ".") for n in tests)] == []


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the modules among ``paths`` it imports, at the top or inside a function (either can close a
    cycle: a function-local import only delays it)."""
    modules = {module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        named = imported_names(path)
        graph[name] = {m for m in modules if m != name and (m in named or any(n.startswith(m + ".") for n in named))}
        graph[name] -= {m for m in graph[name] if name.startswith(m + ".")}  # a package's own __init__
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as the modules around it, or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_function_local_cycle(tmp_path, monkeypatch):
    package = tmp_path / "specviz" / "apps"
    package.mkdir(parents=True)
    (package / "a.py").write_text("from .b import x\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("import specviz.apps.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = cycle(import_graph(sorted(package.glob("*.py"))))
    assert set(found) == {"specviz.apps.a", "specviz.apps.b", "specviz.apps.c"} and found[0] == found[-1]
    (package / "c.py").write_text("import specviz.core\n")
    assert cycle(import_graph(sorted(package.glob("*.py")))) == []


def test_no_import_cycle_inside_the_apps():
    assert cycle(import_graph(APPS)) == []


def test_no_python_file_is_over_400_lines():
    folders = [ROOT / "specviz", ROOT / "drafters", ROOT / "tests", ROOT / "scripts"]
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for f in folders for p in f.rglob("*.py")}
    assert lengths and {p: n for p, n in lengths.items() if n > 400} == {}
