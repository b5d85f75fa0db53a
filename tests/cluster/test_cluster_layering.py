"""Issue 9 item 5: the scheduler stands apart from the compiler, without import cycles, and
its dependencies are an optional extra with a clear message when missing."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

from click.testing import CliRunner

import kiln

ROOT = pathlib.Path(kiln.__file__).parent
APART = ("cluster", "devices")


def _imports(path: pathlib.Path) -> set[str]:
    """Every kiln module ``path`` imports, at top level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kiln"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_cluster_imports_nothing_from_the_compiler():
    for path in (ROOT / "cluster").rglob("*.py"):
        for mod in _imports(path):
            assert _area(mod) in APART or mod == "kiln", f"{path.name} imports {mod}"


# The compiler's layers (issue 9): ir <- lowering/passes <- backends <- runtime <- frontends, with
# precision plugged in, and Kiln's top-level modules.  Tools around it (tools, observe,
# distributed) may use the scheduler and device discovery.
COMPILER = ("ir", "lowering", "passes", "codegen", "backends", "runtime", "frontends", "precision")


def test_compiler_imports_nothing_from_the_scheduler():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if len(rel) > 1 and rel[0] not in COMPILER:
            continue
        for mod in _imports(path):
            assert _area(mod) not in APART, f"{path.relative_to(ROOT)} imports {mod}"


def test_no_import_cycles_inside_the_cluster_package():
    modules = {p.stem: p for p in (ROOT / "cluster").glob("*.py")}
    graph = {
        name: {m.split(".")[2] for m in _imports(p) if m.startswith("kiln.cluster.")} & set(modules)
        for name, p in modules.items()
    }
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*trail, name, dep])
            if dep not in state:
                visit(dep, [*trail, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_cluster_without_its_extra_names_the_install_command(monkeypatch):
    from kiln.cluster import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "botocore" else real(name, *a)
    )
    result = CliRunner().invoke(cli.cluster, ["list-tasks"])
    assert result.exit_code == 1
    assert "pip install 'kiln[cluster]'" in result.output and "botocore" in result.output
