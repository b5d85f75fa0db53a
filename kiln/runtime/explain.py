"""Reports of what the compiler did to each graph (``kiln explain``, ``KILN_EXPLAIN_DIR``).

For every compiled graph: its hash and size, each pass with its time and the node count after it,
what was fused into which kernel (with the generated source), and every op that fell back to eager
ATen with the reason from the fallback table.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
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
    d = Path(dirpath)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{rep['graph']}.json"
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(rep, f, indent=1)
    os.replace(tmp, path)
    return path


def format_report(rep: dict, source: bool = False) -> str:
    lines = [
        f"graph {rep['graph']}: {rep['nodes_in']} nodes -> {rep['nodes_out']} "
        f"({rep['backend']}{', from disk cache' if rep['from_cache'] else ''})"
    ]
    for p in rep["passes"]:
        lines.append(f"  pass {p['name']:<14} {p['ms']:>8.2f} ms  -> {p['nodes']} nodes")
    for k in rep["kernels"]:
        lines.append(f"  kernel {k['name']} ({k['kind']}): fuses {len(k['fused'])} ops")
        lines.append(f"    {', '.join(k['fused'][:16])}{' ...' if len(k['fused']) > 16 else ''}")
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
        lines.append("  no fallbacks")
    return "\n".join(lines)
