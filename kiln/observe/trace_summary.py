"""Where a profiled step's time went, from a Chrome trace (``kiln profile`` prints this).

For each ``ProfilerStep#N`` range: its duration, the share of it inside Kiln's stage ranges
(``kiln::record``, ``kiln::mark_step``, ``kiln::sync``, ``kiln::settle_heap``, ``kiln::compile``,
``kiln::graph``, ``kiln::observe``; counted once where they nest), and the time in generated kernels and ATen fallbacks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

STAGES = (
    "kiln::record",
    "kiln::mark_step",
    "kiln::sync",
    "kiln::settle_heap",
    "kiln::compile",
    "kiln::graph",
    "kiln::observe",
)


def _stage(name: str) -> str:
    return name.split(" ", 1)[0]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _covered(events: list[dict], stages: tuple[str, ...], a: float, b: float) -> float:
    """Time within [a, b] covered by events of ``stages`` (nested ones counted once)."""
    return union_length(
        [
            (max(e["ts"], a), min(e["ts"] + e["dur"], b))
            for e in events
            if _stage(e["name"]) in stages
        ]
    )


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kiln = [e for e in events if str(e.get("name", "")).startswith("kiln::")]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kiln:
        t = totals[_stage(e["name"])]
        t[0] += 1
        t[1] += e["dur"] / 1e3
    steps = []
    for s in events:
        if not str(s.get("name", "")).startswith("ProfilerStep#"):
            continue
        a, b = s["ts"], s["ts"] + s["dur"]
        inside = [
            e for e in kiln if e["tid"] == s["tid"] and e["ts"] < b and e["ts"] + e["dur"] > a
        ]
        steps.append(
            {
                "step": s["name"],
                "ms": s["dur"] / 1e3,
                "kiln_ms": _covered(inside, STAGES, a, b) / 1e3,
                "kernel_ms": _covered(inside, ("kiln::kernel",), a, b) / 1e3,
                "fallback_ms": _covered(inside, ("kiln::fallback",), a, b) / 1e3,
            }
        )
    return {
        "ranges": {k: {"count": int(v[0]), "ms": v[1]} for k, v in sorted(totals.items())},
        "steps": sorted(steps, key=lambda s: int(s["step"].split("#")[1])),
    }


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["Kiln ranges in the trace:"]
    for name, r in summary["ranges"].items():
        lines.append(f"  {name:<16} {r['count']:>6} ranges {r['ms']:>10.2f} ms")
    if not summary["ranges"]:
        lines.append("  none (did the command run Kiln steps while the profiler recorded?)")
    for s in summary["steps"]:
        share = s["kiln_ms"] / s["ms"] if s["ms"] else 0.0
        lines.append(
            f"  {s['step']:<16} {s['ms']:>9.2f} ms: {share:6.1%} in Kiln stages, "
            f"kernels {s['kernel_ms']:.2f} ms, fallbacks {s['fallback_ms']:.2f} ms"
        )
    return "\n".join(lines)
