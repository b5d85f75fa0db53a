"""Formatting of benchmark results: one markdown table plus a footer, and the JSON file.

from bench.report import table, write_json
print(table(result))            # result: the dict bench/run.py builds (rows, machine, ...)
write_json("bench/results.json", result)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

COLUMNS = [
    ("workload", "workload"),
    ("mode", "mode"),
    ("ms_per_step", "ms/step"),
    ("speedup", "vs eager"),
    ("compile_cold_s", "compile cold s"),
    ("compile_warm_s", "compile warm s"),
    ("peak_tensor_mb", "peak tensor MB"),
    ("peak_rss_mb", "peak RSS MB"),
    ("loss_drift", "loss drift"),
    ("mfu_pct", "MFU %"),
    ("kiln_graphs", "Kiln graphs"),
    ("dyn_graphs", "dyn-shape graphs (10 T)"),
    ("note", "note"),
]


def _cell(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v.replace("|", "/").replace("\n", " ")
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if key == "speedup":
        return f"{v:.2f}x"
    if key == "loss_drift":
        return f"{v:.1e}"
    if key in ("compile_cold_s", "compile_warm_s"):
        return f"{v:.1f}"
    if key == "mfu_pct":
        return f"{v:.2f}"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def table(result: dict) -> str:
    """The markdown table of ``result["rows"]`` and a footer explaining how each number is made."""
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, rule]
    for row in result["rows"]:
        lines.append("| " + " | ".join(_cell(k, row.get(k)) for k, _ in COLUMNS) + " |")
    m = result["machine"]
    s = result["settings"]
    lines += [
        "",
        "Workloads: "
        + "; ".join(
            f"{name}: {w['desc']}, {w['gflop_per_step']:.3f} GFLOP/step"
            for name, w in result["workloads"].items()
        ),
        f"Machine: {m['nproc']} CPUs ({m['threads']} torch threads), torch {m['torch']}, "
        f"Python {m['python']}, {m['platform']}; fp32 GEMM peak "
        f"{result['gemm_peak_gflops']:.1f} GFLOP/s (torch.mm 2048x2048, median of "
        f"{s['gemm_reps']}).",
        f"ms/step: median of {s['steps']} measured training steps (forward, backward, AdamW, "
        f"zero_grad, loss.item()) after {s['warmup']} warm-up steps, "
        + (
            "modes interleaved one step each in one process (cold caches every step). "
            if s.get("in_process")
            else f"each mode in its own process, interleaved in rounds of {s.get('block')} steps "
            "per mode (order rotating), less the first step of each round (the switch between "
            "processes, not counted). "
        )
        + "vs eager: eager median / mode median.",
        "compile cold: first step minus median step, with empty Kiln and Inductor caches (fresh "
        "temp dirs). compile warm: the same in a fresh process (forked from a parent that only "
        "imported torch/kiln) reusing those cache dirs.",
        "peak RSS: ru_maxrss of that warm process per (workload, mode), after 1 + "
        f"{s['warm_steps']} steps; it includes the imports (parent RSS before fork: "
        f"{_cell('peak_rss_mb', result.get('baseline_rss_mb'))} MB).",
        "peak tensor: most bytes live at once in PyTorch's CPU allocator (a counting wrapper, "
        "bench/tensor_memory.py) during any of that warm process's steady steps (after its "
        "first); it counts the mode's model copy, gradients, optimizer state, activations and "
        "any buffers a compiler keeps between steps.",
        "loss drift: max over steps of |loss - eager loss| / |eager loss|, identical initial "
        "weights and batches. MFU: FlopCounterMode FLOPs of one eager step / median step time / "
        "GEMM peak.",
        "Kiln graphs: graphs_compiled during this mode's run (Kiln modes).",
    ]
    if result.get("dyn_lengths"):
        lines.append(
            "dyn-shape graphs: graphs_compiled while a fresh GPT model/step trains at 10 sequence "
            f"lengths ({', '.join(map(str, result['dyn_lengths']))}); target: at most 2 per mode."
        )
    return "\n".join(lines)


def write_json(path: str | Path, result: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, default=str) + "\n")
