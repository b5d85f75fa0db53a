"""Reports of what the compiler did to each graph (``kiln explain``, ``KILN_EXPLAIN_DIR``).

For every compiled graph: its hash and size, each pass with its time and the node count after it,
what was fused into which kernel (with the generated source), and every op that fell back to eager
ATen with the reason from the fallback table.  For the run (one ``run-<pid>.json`` per process that
compiled, written when it ends): its steps, and what no graph shows -- the forced syncs that cut a
step into several graphs, and the ops run on ATen between graphs -- from :mod:`kiln.metrics`.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path

from kiln import metrics
from kiln.ir.graph import Graph
from kiln.ir.ops import Category, opaque_target
from kiln.lowering.fallback import reason
from kiln.runtime.gemm_epilogues import gemm_epilogues


def fallbacks(g: Graph) -> list[dict[str, str]]:
    out = []
    for i, n in enumerate(g.nodes):
        if n.category is Category.OPAQUE:
            target = opaque_target(n.op)
            packet = target.split("::", 1)[-1].split(".", 1)[0]
            out.append({"node": i, "op": target, "reason": reason(packet)})
    return out


def report(source: Graph, optimized: Graph, passes: list, info: dict, cached: bool) -> dict:
    kernels = info.get("kernels", [])
    return {
        "graph": source.hash,
        "nodes_in": len(source),
        "nodes_out": len(optimized),
        "from_cache": cached,
        "backend": info.get("backend", "interpreter"),
        "passes": [{"name": n, "ms": round(dt * 1e3, 3), "nodes": len(g)} for n, dt, g in passes],
        "kernels": [
            {
                "name": k["name"],
                "kind": k.get("kind"),
                "fused": _body_ops(optimized, k),
                "source": k.get("source", ""),
            }
            for k in kernels
        ],
        "fallbacks": fallbacks(optimized),
        "gemms": gemm_epilogues(optimized),
        "graph_text": str(optimized),
    }


def _body_ops(g: Graph, kernel: dict) -> list[str]:
    """The ops fused into a kernel, from its fused node's body."""
    node = g.nodes[kernel["node"]] if "node" in kernel else None
    body = node.kwarg("body", ()) if node is not None else ()
    return [entry[0] for entry in body]


def write(dirpath: str, rep: dict) -> Path:
    """Write a graph's report; the first one also arranges the run's (:func:`write_run`)."""
    if dirpath not in _runs:
        _runs.add(dirpath)
        atexit.register(write_run, dirpath)
    return _write_json(Path(dirpath) / f"{rep['graph']}.json", rep)


_runs: set[str] = set()  # explain folders this process writes its run's report into at exit


def write_run(dirpath: str) -> Path:
    """The run's report: steps, forced syncs by reason, ops run on ATen (in graphs or between
    them), recompiles; compile mode's last step counted first (:func:`metrics.run_ending`)."""
    metrics.run_ending()
    c = metrics.counters()
    rep = {
        "pid": os.getpid(),
        "steps": c["steps"],
        "graphs_executed": c["graphs_executed"],
        "syncs": c["syncs"],
        "fallbacks": c["fallbacks"],
        "recompiles": [f"{site}: {why}" for site, why in c["recompile_reasons"]],
    }
    return _write_json(Path(dirpath) / f"run-{os.getpid()}.json", rep)


def _write_json(path: Path, rep: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(rep, f, indent=1)
    os.replace(tmp, path)
    return path


def format_report(rep: dict, source: bool = False) -> str:
    cached = ", from disk cache" if rep["from_cache"] else ""
    lines = [
        f"graph {rep['graph']}: {rep['nodes_in']} nodes -> {rep['nodes_out']} ({rep['backend']}{cached})"
    ]
    for p in rep["passes"]:
        lines.append(f"  pass {p['name']:<14} {p['ms']:>8.2f} ms  -> {p['nodes']} nodes")
    if rep["from_cache"] and not rep["passes"]:
        lines.append("  passes: not run in this process (the optimized graph came from the cache)")
    for k in rep["kernels"]:
        if not k["fused"]:  # a kernel for one node of its own (no fused body)
            lines.append(f"  kernel {k['name']} ({k['kind']})")
        else:
            lines.append(f"  kernel {k['name']} ({k['kind']}): fuses {len(k['fused'])} ops")
            more = " ..." if len(k["fused"]) > 16 else ""
            lines.append(f"    {', '.join(k['fused'][:16])}{more}")
        if source:
            lines.extend("      " + ln for ln in k["source"].splitlines())
    for m in rep.get("gemms", []):
        lines.append(
            f"  gemm %{m['node']} {m['op']} [{m['library']}]: fused {m['fused']}; after: {m['after']}"
        )
        lines.append(f"    operands: {'; '.join(m['operands'])}")
    if rep["fallbacks"]:
        lines.append("  fell back to eager ATen:")
        for fb in rep["fallbacks"]:
            lines.append(f"    %{fb['node']} {fb['op']}: {fb['reason']}")
    else:
        lines.append("  no fallbacks in this graph")
    return "\n".join(lines)


def format_run(rep: dict) -> str:
    """A run's report (:func:`write_run`): what cut its steps and what ran outside Kiln."""
    steps = rep["steps"]
    per_step = f", {rep['graphs_executed'] / steps:.3g} graphs a step" if steps else ""
    lines = [f"run (pid {rep['pid']}): {steps} steps{per_step}"]
    if rep["syncs"]:
        lines.append("  forced syncs (each ends a graph mid-step; kiln.metrics.report() has them):")
        lines += [f"    {why}: {n}" for why, n in sorted(rep["syncs"].items(), key=lambda x: -x[1])]
    else:
        lines.append("  no forced syncs")
    if rep["fallbacks"]:
        lines.append("  ops run on ATen, in graphs or between them:")
        lines += [
            f"    {op}: {n}" for op, n in sorted(rep["fallbacks"].items(), key=lambda x: -x[1])
        ]
    for r in rep["recompiles"]:
        lines.append(f"  recompiled {r}")
    return "\n".join(lines)
