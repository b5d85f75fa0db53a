"""Where compile mode's first step goes, cold (empty caches) and warm (a new process, same caches).

    python bench/compile_stages.py --workloads mlp,gpt,cnn,gpt2,bert,llama
    python bench/compile_stages.py --workloads mlp --quick
    python bench/compile_stages.py --workloads gpt2,bert --starts cold --threads 1

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
- other: the rest of the first step (running the graphs, Python around them, and waiting for
  g++ where a graph's first run comes before the build threads have finished its units);
- first step CPU s / g++ CPU s: CPU time (user + system) of the measuring process during the
  first step, and of the g++ processes that ended meanwhile.  On a loaded machine these say more
  than the wall-clock columns (``--threads 1`` also keeps OpenMP from spinning against other
  processes);
- g++ wait s: of the first step, the time graphs' first runs waited for their kernels' builds
  (``kernel_wait_us``; part of "other", or of "kiln compile" where a build was waited for there).

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
import resource
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


def child_saved(
    name: str, steps: int, quick: bool, path: str, save: bool, threads: int = 2
) -> dict:
    """Save (``save``) or load and time the workload's loss function compiled whole."""
    global _WL
    sys.path.insert(0, ROOT)
    import torch

    import kiln
    from bench.workloads import build

    torch.set_num_threads(threads)
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


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished children (g++)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def child(name: str, steps: int, quick: bool, threads: int = 2) -> dict:
    """Run in the measuring process: one workload's compiled steps, the first one split."""
    sys.path.insert(0, ROOT)
    import torch

    import kiln
    from bench.run import make_step
    from bench.workloads import build

    torch.set_num_threads(threads)
    wl = build(name, quick, 1 + steps)
    step = make_step(wl.model, wl.loss, "kiln")
    times = []
    cpu0 = _cpu()
    for i, batch in enumerate(wl.batches):
        t0 = time.perf_counter()
        step(*batch).item()
        times.append(time.perf_counter() - t0)
        if i == 0:
            cpu1 = _cpu()
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
    row = _result(first, split)
    # the first step's CPU time (not less a steady step): Python, and g++ children
    row["cpu_s"], row["gxx_cpu_s"] = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    row["gxx_wait_s"] = kiln.metrics.get("kernel_wait_us") / 1e6
    return row


def run_child(name: str, cache: str, a: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict:
    env = {
        **os.environ,
        "KILN_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(a.steps)]
    cmd += ["--threads", str(a.threads)]
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
    cells += [f"{row[k]:.2f}" if k in row else "-" for k in ("cpu_s", "gxx_cpu_s", "gxx_wait_s")]
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp,gpt,cnn,gpt2,bert,llama")
    ap.add_argument("--steps", type=int, default=3, help="steps after the first (its baseline)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in each process")
    ap.add_argument(
        "--starts", default="cold,warm,saved", help="which rows: any of cold,warm,saved"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--child", default="", help="internal: measure this workload in-process")
    ap.add_argument("--saved", default="", help="internal: with --child, the saved function")
    ap.add_argument("--save", action="store_true", help="internal: with --saved, write it")
    a = ap.parse_args(argv)
    if a.child:
        if a.saved:
            print(json.dumps(child_saved(a.child, a.steps, a.quick, a.saved, a.save, a.threads)))
        else:
            print(json.dumps(child(a.child, a.steps, a.quick, a.threads)))
        return
    head = ["workload", "start", "first step s", *STAGES, "g++ units", "AOT cache hits"]
    head += ["first step CPU s", "g++ CPU s", "g++ wait s"]
    starts = a.starts.split(",")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = []
    for name in a.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix="kiln-stages-") as cache:
            for start in [s for s in ("cold", "warm") if s in starts]:
                r = run_child(name, cache, a)
                rows.append({"workload": name, "start": start, **r})
                print(f"| {name} | {start} | {fmt(r)} |", flush=True)
            if "saved" not in starts:
                continue
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
