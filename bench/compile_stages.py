"""Where compile mode's first step goes, cold (empty caches) and warm (a new process, same caches).

    python bench/compile_stages.py --workloads mlp,gpt,cnn,gpt2,bert,llama
    python bench/compile_stages.py --workloads mlp --quick

For each workload, two fresh processes in turn share one cache folder: the first starts with it
empty (cold), the second finds what the first left (warm).  Each builds the workload, runs
``torch.compile(step, backend="kiln")`` for 1 + ``--steps`` training steps and reports the first
step minus the median of the others (as bench/run.py's compile columns), split by stage from
Dynamo's ``compilation_time_metrics`` (what ``torch._dynamo.utils.compile_times()`` prints) and Kiln's metrics:

- dynamo: Dynamo's frame compiles (bytecode tracing and the rest), less guards and backend calls;
- guards: building Dynamo's guards;
- aot: the backend calls (AOTAutograd: its cache key and lookup, tracing, partitioning), less Kiln;
- kiln compile / kiln load: Kiln's passes and C++ builds (a miss) or loading them (a hit);
- g++ units: kernel translation units g++ built (``kernel_builds``);
- other: the rest of the first step (running the graphs, Python around them).

A third row per workload (``saved``) loads the workload's loss function (forward and loss; its
backward runs through the loaded graphs too, the optimizer is not part of it) that a fourth
process compiled whole (``fullgraph=True``) with ``aot_compile`` and saved: no Dynamo, no
AOTAutograd in the loading process.  Its first step is the load plus the first call minus a
steady call.  A workload whose loss function does not compile whole shows the error.

Timings on a shared machine are noisy: compare the split, and rerun for absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAGES = ("dynamo", "guards", "aot", "kiln compile", "kiln load", "other")
_WL = None  # the workload of a --saved child: the saved loss function reads it as a global


def _result(first: float, split: dict[str, float]) -> dict:
    """One row: first-step seconds, its split by stage, and Kiln's build/cache counters."""
    import kiln

    return {
        "first_s": first,
        "split": split,
        "kernel_builds": kiln.metrics.get("kernel_builds"),
        "aot_cache_hits": kiln.metrics.get("aot_cache_hits"),
        "graphs_compiled": kiln.metrics.get("graphs_compiled"),
    }


def _loss(model: Any, batch: Any) -> Any:  # compiled whole, saved and loaded
    return _WL.loss(model, batch)


def child_saved(name: str, steps: int, quick: bool, path: str, save: bool) -> dict:
    """Save (``save``) or load and time the workload's loss function compiled whole."""
    global _WL
    sys.path.insert(0, ROOT)
    import torch

    import kiln
    from bench.workloads import build

    torch.set_num_threads(2)
    _WL = build(name, quick, 1 + steps)
    model = _WL.model
    if save:
        example = ((model, _WL.batches[0]), {})
        f = torch.compile(_loss, backend="kiln", fullgraph=True).aot_compile(example)
        f.save_compiled_function(path)
        return {}
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        f = torch.compiler.load_compiled_function(fh, f_globals=globals())
    load_s = time.perf_counter() - t0
    times = []
    for batch in _WL.batches:
        t0 = time.perf_counter()
        f(model, batch).backward()
        model.zero_grad()
        times.append(time.perf_counter() - t0)
    first = load_s + times[0] - statistics.median(times[1:])
    m = kiln.metrics.snapshot()
    split = dict.fromkeys(STAGES, 0.0)
    split.update({"kiln load": m["load_s"], "other": first - m["load_s"]})
    split["dynamo"] = sum(
        torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", [])
    )
    return _result(first, split)


def child(name: str, steps: int, quick: bool) -> dict:
    """Run in the measuring process: one workload's compiled steps, the first one split."""
    sys.path.insert(0, ROOT)
    import torch

    import kiln
    from bench.run import make_step
    from bench.workloads import build

    torch.set_num_threads(2)
    wl = build(name, quick, 1 + steps)
    step = make_step(wl.model, wl.loss, "kiln")
    times = []
    for batch in wl.batches:
        t0 = time.perf_counter()
        step(*batch).item()
        times.append(time.perf_counter() - t0)
    ct = torch._dynamo.utils.compilation_time_metrics  # name -> seconds of each call

    def total(key: str) -> float:
        return float(sum(ct.get(key, [])))

    m = kiln.metrics.snapshot()
    backend = total("OutputGraph.call_user_compiler")
    kiln_compile = m["compile_s"]
    kiln_load = m["load_s"]
    first = times[0] - statistics.median(times[1:])
    split = {
        "dynamo": total("_compile.compile_inner") - backend - total("build_guards"),
        "guards": total("build_guards"),
        "aot": backend - kiln_compile - kiln_load,
        "kiln compile": kiln_compile,
        "kiln load": kiln_load,
    }
    split["other"] = first - sum(split.values())
    return _result(first, split)


def run_child(name: str, cache: str, a: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    env = {
        **os.environ,
        "KILN_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(a.steps)]
    cmd += list(extra)
    p = subprocess.run(
        cmd + (["--quick"] if a.quick else []),
        env=env,
        capture_output=True,
        text=True,
        timeout=a.timeout,
        check=False,
    )
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines() or ["no output"]
        print("\n".join(lines[-12:]), file=sys.stderr)
        # the exception's own line (Dynamo prints hints after it)
        raised = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Unsupported): ", ln)]
        return {"error": (raised or lines)[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def fmt(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    cells = [f"{row['first_s']:.2f}"] + [f"{row['split'][s]:.2f}" for s in STAGES]
    cells += [str(row["kernel_builds"]), str(row["aot_cache_hits"])]
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp,gpt,cnn,gpt2,bert,llama")
    ap.add_argument("--steps", type=int, default=3, help="steps after the first (its baseline)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--child", default="", help="internal: measure this workload in-process")
    ap.add_argument("--saved", default="", help="internal: with --child, the saved function")
    ap.add_argument("--save", action="store_true", help="internal: with --saved, write it")
    a = ap.parse_args(argv)
    if a.child:
        if a.saved:
            print(json.dumps(child_saved(a.child, a.steps, a.quick, a.saved, a.save)))
        else:
            print(json.dumps(child(a.child, a.steps, a.quick)))
        return
    head = ["workload", "start", "first step s", *STAGES, "g++ units", "AOT cache hits"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = []
    for name in a.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix="kiln-stages-") as cache:
            for start in ("cold", "warm"):
                r = run_child(name, cache, a)
                rows.append({"workload": name, "start": start, **r})
                print(f"| {name} | {start} | {fmt(r)} |", flush=True)
            saved = os.path.join(cache, "loss_fn.saved")
            r = run_child(name, cache, a, ("--saved", saved, "--save"))
            if "error" not in r:
                r = run_child(name, cache, a, ("--saved", saved))
            rows.append({"workload": name, "start": "saved", **r})
            print(f"| {name} | saved | {fmt(r)} |", flush=True)
    print(f"load average at the end: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
