"""The package layering, read from the code's own imports (``ast``; nothing is imported).

Each layer imports only from layers below it (``kiln.config`` and ``kiln.metrics`` are below all)::

    ir  <-  lowering, passes  <-  backends (codegen: cpp, interpreter)  <-  runtime
        <-  frontends (lazy, compile)  <-  tools, observe  <-  the ``kiln`` package itself

Sibling packages of one layer do not import each other.  ``cluster`` and ``devices`` stand apart:
they import nothing from the compiler and the compiler nothing from them.  ``precision`` and
``distributed`` plug into the stack: they may use the compiler layers below the frontends.  No
module takes part in an import cycle (a function-level import counts: it is a cycle all the same;
imports under ``if TYPE_CHECKING:`` do not).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kiln"

# package prefix -> (rank, group); lower ranks are imported by higher ones
LAYERS: dict[str, tuple[int, str]] = {
    "kiln.config": (0, "base"),
    "kiln.metrics": (0, "base"),
    "kiln.ir": (1, "ir"),
    "kiln.lowering": (2, "lowering"),
    "kiln.passes": (2, "passes"),
    "kiln.codegen": (3, "backends"),
    "kiln.runtime": (4, "runtime"),
    "kiln.frontends.lazy": (5, "lazy"),
    "kiln.frontends.compile": (5, "compile"),
    "kiln.frontends": (5, "frontends"),
    "kiln.tools": (6, "tools"),
    "kiln.observe": (6, "observe"),  # beside tools: kiln ls/top/profile, TensorBoard, ranges
    "kiln": (7, "kiln"),  # the package: re-exports the frontends, installs observe's step hook
}
PLUGINS = {"kiln.precision": 4, "kiln.distributed": 4}  # may import up to this rank
# The scheduler stands apart from the compiler (both ways); inside it, devices sit below cluster.
APART = {"kiln.devices": 0, "kiln.cluster": 1}
# Tools that list the host's devices (kiln ls / kiln top) may read kiln.devices.
DEVICE_READERS = ("kiln.observe",)
# Known violations being removed by other work, each with its issue; delete a line when it lands.
PENDING: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _target(name: str) -> str | None:
    """The Kiln module an imported name refers to (``kiln.ir.graph.Graph`` -> ``kiln.ir.graph``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str) -> set[str]:
    path = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "kiln":
                        found.add(_target(a.name) or a.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")
                    up = up[: len(up) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "kiln":
                    continue
                for a in child.names:
                    t = _target(f"{base}.{a.name}") or _target(base)
                    if t is not None:
                        found.add(t)
            visit(child)

    visit(tree)
    found.discard(mod)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def _layer(mod: str) -> tuple[str, int, str] | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if mod == prefix or mod.startswith(prefix + "."):
            return (prefix, *LAYERS[prefix])
    return None


def _under(mod: str, prefixes) -> str | None:
    return next((p for p in prefixes if mod == p or mod.startswith(p + ".")), None)


def test_every_module_has_a_place():
    lost = [m for m in MODULES if _layer(m) is None and not _under(m, (*APART, *PLUGINS))]
    assert not lost, f"modules with no layer (add their package to LAYERS): {lost}"


def test_each_layer_imports_only_layers_below_it():
    bad = []
    for mod, deps in GRAPH.items():
        for dep in deps:
            if (mod, dep) in PENDING:
                continue
            am, ad = _under(mod, APART), _under(dep, APART)
            if am or ad:
                base = _layer(dep) is not None and _layer(dep)[1] == 0
                if am and ad and APART[ad] > APART[am]:
                    bad.append(f"{mod} -> {dep} (devices sit below cluster)")
                elif ad == "kiln.devices" and _under(mod, DEVICE_READERS):
                    pass
                elif not (am and ad) and not (am and base):
                    bad.append(f"{mod} -> {dep} (cluster/devices and the compiler stand apart)")
                continue
            plug = _under(mod, PLUGINS)
            if plug is not None:
                if _under(dep, PLUGINS):
                    continue
                lay = _layer(dep)
                if lay is not None and lay[1] > PLUGINS[plug]:
                    bad.append(f"{mod} -> {dep} (a plug-in uses layers up to the runtime)")
                continue
            if _under(dep, PLUGINS):
                continue
            a, b = _layer(mod), _layer(dep)
            if a is None or b is None or a[0] == b[0] or a[0].startswith(b[0] + "."):
                continue  # within one package
            if b[1] > a[1] or (b[1] == a[1] and not b[0] in a[0]):
                bad.append(f"{mod} ({a[2]}) -> {dep} ({b[2]})")
    assert not bad, "imports against the layering:\n  " + "\n  ".join(sorted(bad))


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    edges = {
        m: sorted(d for d in deps if d in GRAPH and (m, d) not in PENDING)
        for m, deps in GRAPH.items()
    }
    for root in sorted(GRAPH):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            recurse = False
            for k in range(i, len(edges[v])):
                w = edges[v][k]
                if w not in index:
                    work.append((v, k + 1))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


def test_no_import_cycles():
    assert not _cycles(), f"import cycles: {_cycles()}"


def test_the_checker_sees_a_violation(tmp_path):
    """The checks above can fail: an upward import and a cycle are both found."""
    saved = {m: set(d) for m, d in GRAPH.items()}
    try:
        GRAPH["kiln.ir.graph"].add("kiln.runtime.compiler")
        with pytest.raises(AssertionError, match="kiln.ir.graph"):
            test_each_layer_imports_only_layers_below_it()
        with pytest.raises(AssertionError, match="import cycles"):
            test_no_import_cycles()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_imports_are_read_from_source():
    assert "kiln.ir.semantics" in GRAPH["kiln.ir.verifier"]
    assert "kiln.ir.node" in GRAPH["kiln.ir.printer"]
    assert "kiln.ir.graph" not in GRAPH["kiln.ir.printer"]
