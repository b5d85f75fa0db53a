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

Timings on a shared machine are noisy: compare the split, and rerun for absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAGES = ("dynamo", "guards", "aot", "kiln compile", "kiln load", "other")


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
    return {
        "first_s": first,
        "split": split,
        "kernel_builds": kiln.metrics.get("kernel_builds"),
        "aot_cache_hits": kiln.metrics.get("aot_cache_hits"),
        "graphs_compiled": kiln.metrics.get("graphs_compiled"),
    }


def run_child(name: str, cache: str, a: argparse.Namespace) -> dict:
    env = {
        **os.environ,
        "KILN_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(a.steps)]
    p = subprocess.run(
        cmd + (["--quick"] if a.quick else []),
        env=env,
        capture_output=True,
        text=True,
        timeout=a.timeout,
        check=False,
    )
    if p.returncode != 0:
        tail = p.stderr.strip().splitlines()[-12:] or ["no output"]
        print("\n".join(tail), file=sys.stderr)
        return {"error": tail[-1][:200]}
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
    a = ap.parse_args(argv)
    if a.child:
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
    print(f"load average at the end: {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
