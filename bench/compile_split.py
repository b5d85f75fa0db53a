"""Where a compile-mode cold first step goes, by thread CPU time, in one fresh process per workload.

    python bench/compile_split.py --workloads gpt2,llama-large,bert
    python bench/compile_split.py --workloads mlp --quick
    python bench/compile_split.py --workloads gpt2 --nested-graph-breaks   # Dynamo's option on

Each workload runs in its own process with empty Kiln and Inductor caches (a temporary folder, as
bench/compile_stages.py).  The process compiles ``torch.compile(step, backend="kiln")`` and runs
its first step, then reports:

- first step: the main thread's CPU time for the whole first step (Dynamo, AOTAutograd, Kiln, the
  graphs' first runs; g++ runs in other processes and is not in it);
- per backend call (one per Dynamo graph): its size, and the main thread's CPU time in the call
  (AOTAutograd and Kiln's compile of every graph AOTAutograd makes of it; for a graph without
  autograd, the optimizer step, its recording and Kiln's compile); the rest of the first
  step is Dynamo (tracing, guards, bytecode) and the graphs' runs;
- Kiln, per graph Kiln compiled: lowering (``fx_to_kiln``), the pass pipeline (CPU; each pass by
  the pipeline's wall-clock timer), and the C++ source emission, measured again after the step
  on the same graphs (median of ``--repeat`` runs; the kernels are in the cache by then: no g++);
- g++: each unit's start and end and each backend call's end (seconds since the step began, wall
  clock), and how long each graph's first run waited for its units.

Timings on a shared machine are noisy: CPU times say more than wall times; rerun and compare.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(name: str, quick: bool, repeat: int, nested: bool = False) -> None:
    """Measure one workload in this process (its caches set by the parent) and print the report;
    ``nested``: Dynamo's ``nested_graph_breaks`` on (torch's default is off)."""
    sys.path.insert(0, ROOT)
    import torch

    torch._dynamo.config.nested_graph_breaks = nested

    from bench.run import make_step
    from bench.workloads import build
    from kiln.codegen import cpp, get_backend
    from kiln.config import config
    from kiln.frontends.compile import backend as be
    from kiln.passes.pipeline import run_pipeline

    bld = importlib.import_module("kiln.codegen.cpp.build")
    torch.set_num_threads(1)
    t_start = [time.perf_counter()]
    events: list[str] = []
    graphs: list[tuple[Any, Any]] = []  # (fx graph module, Kiln graph) of each Kiln compile

    def stamp() -> str:
        return f"{time.perf_counter() - t_start[0]:7.2f} s"

    make_aot, lower = be._aot_backend, be.fx_to_kiln

    def timed_aot(options: dict[str, Any]) -> Any:
        f = make_aot(options)

        def call(gm: torch.fx.GraphModule, example_inputs: list, **kw: Any) -> Any:
            t = time.thread_time()
            res = f(gm, example_inputs, **kw)
            n = sum(1 for x in gm.graph.nodes if x.op == "call_function")
            events.append(
                f"{stamp()}  backend call ended: Dynamo graph of {n} calls, {len(example_inputs)} "
                f"inputs: {time.thread_time() - t:.3f} s CPU (AOTAutograd + Kiln)"
            )
            return res

        return call

    direct = be.try_compile

    def timed_direct(gm: torch.fx.GraphModule, example_inputs: list, *a: Any) -> Any:
        t = time.thread_time()
        res = direct(gm, example_inputs, *a)
        n = sum(1 for x in gm.graph.nodes if x.op in ("call_function", "call_method"))
        if res is not None:
            events.append(
                f"{stamp()}  backend call ended: Dynamo graph of {n} calls, {len(example_inputs)} "
                f"inputs: {time.thread_time() - t:.3f} s CPU (no autograd: recorded + Kiln)"
            )
        return res

    def spy_lower(gm: torch.fx.GraphModule) -> Any:
        res = lower(gm)
        graphs.append((gm, res[0]))
        return res

    build_unit, wait = bld._build_unit, bld.PendingKernels.wait

    def timed_build_unit(source: str, key: str, d: Any, index: tuple) -> Any:
        events.append(f"{stamp()}  g++ start {key[:8]} ({len(source)} chars)")
        res = build_unit(source, key, d, index)
        events.append(f"{stamp()}  g++ end   {key[:8]}")
        return res

    def timed_wait(self: Any) -> Any:
        pending = sorted({u.key[:8] for u, _ in self._libs.values() if hasattr(u, "key")})
        t = time.perf_counter()
        res = wait(self)
        if pending:
            events.append(
                f"{stamp()}  first run waited {time.perf_counter() - t:.2f} s for {pending}"
            )
        return res

    be._aot_backend, be.fx_to_kiln, be.try_compile = timed_aot, spy_lower, timed_direct
    bld._build_unit, bld.PendingKernels.wait = timed_build_unit, timed_wait
    wl = build(name, quick, 2)
    step = make_step(wl.model, wl.loss, "kiln")
    t_start[0] = time.perf_counter()
    t = time.thread_time()
    step(*wl.batches[0]).item()
    first = time.thread_time() - t
    be._aot_backend, be.fx_to_kiln, be.try_compile = make_aot, lower, direct
    bld._build_unit, bld.PendingKernels.wait = build_unit, wait
    print(f"{name}: first step {first:.2f} s main-thread CPU, load {os.getloadavg()[0]:.1f}")
    print("\n".join(events))
    cpp_backend = get_backend(config.backend)
    totals: dict[str, float] = {}
    for gi, (gm, g) in enumerate(graphs):
        times: dict[str, list[float]] = {}
        for _ in range(repeat):
            t = time.thread_time()
            lower(gm)
            times.setdefault("lowering", []).append(time.thread_time() - t)
            trace: list = []
            t = time.thread_time()
            opt = run_pipeline(g, trace, cpp_backend.passes())
            times.setdefault("passes", []).append(time.thread_time() - t)
            for pname, dt, _ in trace:  # each pass: the pipeline's own (wall-clock) timer
                times.setdefault(f"  {pname}", []).append(dt)
            t = time.thread_time()
            cpp.build(opt)
            times.setdefault("emission", []).append(time.thread_time() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = ", ".join(f"{k.strip()} {v * 1e3:.1f}" for k, v in med.items())
        print(f"Kiln graph {gi} ({len(g)} nodes), ms: {cells}")
        for k in ("lowering", "passes", "emission"):
            totals[k] = totals.get(k, 0.0) + med[k]
    cells = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in totals.items())
    print(f"Kiln total, ms CPU: {cells} (of {first * 1e3:.0f} ms)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="gpt2,llama-large,bert")
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--repeat", type=int, default=5, help="runs of Kiln's stages per graph")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    ap.add_argument(
        "--nested-graph-breaks",
        action="store_true",
        help="torch._dynamo.config.nested_graph_breaks = True (a graph break in a nested call "
        "resumes there instead of re-tracing each enclosing frame)",
    )
    ap.add_argument("--child", default="", help="internal: measure this workload in-process")
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.quick, a.repeat, a.nested_graph_breaks)
        return
    for name in a.workloads.split(","):
        with tempfile.TemporaryDirectory(prefix="kiln-split-") as cache:
            env = {
                **os.environ,
                "KILN_CACHE_DIR": cache,
                "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
            }
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
            cmd += ["--repeat", str(a.repeat)] + (["--quick"] if a.quick else [])
            cmd += ["--nested-graph-breaks"] if a.nested_graph_breaks else []
            p = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=a.timeout, check=False
            )
            print(p.stdout, end="" if p.stdout.endswith("\n") else "\n", flush=True)
            if p.returncode != 0:
                print("\n".join(p.stderr.strip().splitlines()[-12:]), file=sys.stderr)


if __name__ == "__main__":
    main()
