"""Where a steady lazy training step goes, beside the same step in eager and compile mode.

    python bench/lazy_steps.py                          # mlp, gpt, cnn; 10 measured steps
    python bench/lazy_steps.py --workloads gpt --steps 20 --threads 1
    python bench/lazy_steps.py --workloads gpt --cprofile 5   # + cProfile of 5 lazy steps

The step is bench/run.py's (forward, backward, AdamW, zero_grad, ``loss.item()``; the lazy device
adds ``mark_step``), the three modes interleaved round-robin, each on its own copy of the model.
For the lazy step it splits the time into: upload (the batch's ``.to(kiln)``), record (the Python
step up to ``mark_step``), mark_step (cut + lookup + launch), of which the kernels (``execute``,
kiln.metrics), and ``loss.item()``.  It also prints the process CPU time per step and the graphs
that ran in one steady step of each Kiln mode: nodes, fused kernels, and every other node by op
(ATen calls, copies, writebacks), so the recorded graph can be compared with compile mode's.

Medians over ``--steps`` steps after ``--warmup``; the machine is shared, so numbers vary (the
load average is printed).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kiln  # noqa: E402
from bench.run import make_step  # noqa: E402
from bench.workloads import build  # noqa: E402
from kiln import metrics  # noqa: E402
from kiln.runtime.compiler import executables  # noqa: E402


def _exec_s() -> float:
    return metrics.snapshot().get("execute_s", 0.0)


class Mode:
    def __init__(self, mode: str, wl) -> None:  # noqa: ANN001
        self.mode = mode
        self.dev = kiln.device() if mode == "lazy" else torch.device("cpu")
        model = copy.deepcopy(wl.model).to(self.dev)
        self.loss_fn = wl.loss
        self.loss_fn_box = [wl.loss]  # the loss function the step calls (profiling swaps it)
        box = self.loss_fn_box
        self.step = make_step(model, lambda mod, b: box[0](mod, b), mode)
        self.phases: dict[str, list[float]] = {
            k: [] for k in ("total", "cpu", "upload", "record", "mark_step", "execute", "item")
        }

    def run(self, batch: tuple, keep: bool) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        xs = tuple(t.to(self.dev) for t in batch)
        t1 = time.perf_counter()
        loss = self.step(*xs)
        t2 = time.perf_counter()
        e0 = _exec_s()
        if self.mode == "lazy":
            kiln.mark_step()
        t3 = time.perf_counter()
        e1 = _exec_s()
        loss.item()
        t4 = time.perf_counter()
        c1 = time.process_time()
        if keep:
            p = self.phases
            p["total"].append(t4 - t0)
            p["cpu"].append(c1 - c0)
            p["upload"].append(t1 - t0)
            p["record"].append(t2 - t1)
            p["mark_step"].append(t3 - t2)
            p["execute"].append(e1 - e0)
            p["item"].append(t4 - t3)


def _graphs_of_one_step(m: Mode, batch: tuple) -> list:
    before = {id(e): e.runs for e in executables()}
    m.run(batch, keep=False)
    return [e for e in executables() if e.runs != before.get(id(e), 0)]


def _describe(exes: list) -> str:
    lines = []
    for e in exes:
        g = e.graph
        ops = Counter(n.op for n in g.nodes if n.op not in ("input", "scalar", "fused"))
        fused = g.count(lambda n: n.op == "fused")
        ins = g.count(lambda n: n.op == "input")
        lines.append(
            f"    graph {e.source_graph_hash[:10]}: {len(g)} nodes, {ins} inputs, "
            f"{fused} fused kernels, other: "
            + ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
        )
    return "\n".join(lines)


def bench(name: str, a: argparse.Namespace) -> None:
    torch._dynamo.reset()
    metrics.reset()
    wl = build(name, False, a.warmup + a.steps + 2)
    modes = [Mode(m, wl) for m in a.modes]
    for i, batch in enumerate(wl.batches[: a.warmup + a.steps]):
        k = i % len(modes)
        for m in modes[k:] + modes[:k]:
            m.run(batch, keep=i >= a.warmup)
    print(f"## {name}: {wl.desc}  (load average {os.getloadavg()[0]:.1f})")
    med = {m.mode: {k: statistics.median(v) * 1e3 for k, v in m.phases.items()} for m in modes}
    eager = med.get("eager", {}).get("total")
    for m in modes:
        d = med[m.mode]
        extra = f"  vs eager {eager / d['total']:.2f}x" if eager else ""
        print(f"  {m.mode:6s} {d['total']:7.2f} ms/step (process CPU {d['cpu']:.2f} ms){extra}")
        if m.mode == "lazy":
            print(
                "         upload {upload:.2f}, record {record:.2f}, mark_step {mark_step:.2f} "
                "(kernels {execute:.2f}), item {item:.2f} ms".format(**d)
            )
    c = metrics.counters()
    print(
        f"  counters so far: forced syncs {c.get('syncs')}, fallbacks {c.get('fallbacks')}, "
        f"shape-generic graphs {c.get('shape_generic_graphs', 0)} "
        f"(reuses {c.get('shape_generic_reuses', 0)})"
    )
    for m in modes:
        if m.mode in ("kiln", "lazy"):
            print(f"  {m.mode} graphs of one steady step:")
            print(_describe(_graphs_of_one_step(m, wl.batches[-2])))
    lazy = next((m for m in modes if m.mode == "lazy"), None)
    if a.cprofile and lazy is not None:
        _profile(lazy, wl.batches[-1], a.cprofile, a.top)


def _profile(m: Mode, batch: tuple, steps: int, top: int) -> None:
    """cProfile of ``steps`` lazy steps, the backward pass included: PyTorch runs the backward of
    kiln tensors on its autograd thread for the device, which gets a profiler of its own (started
    by a hook on the loss gradient, stopped at the end of the backward pass on that thread)."""
    main, worker = cProfile.Profile(), cProfile.Profile()
    engine = torch.autograd.Variable._execution_engine

    def start_worker(grad: torch.Tensor) -> torch.Tensor:
        worker.enable()
        engine.queue_callback(worker.disable)
        return grad

    # the loss hook must be registered before backward runs: wrap the model's loss function
    wrapped_loss = m.loss_fn

    def loss_fn(model: torch.nn.Module, b: tuple) -> torch.Tensor:
        loss = wrapped_loss(model, b)
        loss.register_hook(start_worker)
        return loss

    m.loss_fn_box[0] = loss_fn
    main.enable()
    for _ in range(steps):
        m.run(batch, keep=False)
    main.disable()
    m.loss_fn_box[0] = wrapped_loss
    st = pstats.Stats(main)
    try:
        st.add(worker)
    except TypeError:  # the worker profiler never ran
        print("  (no backward-thread profile)")
    st.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp,gpt,cnn")
    ap.add_argument("--modes", default="eager,kiln,lazy")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cprofile", type=int, default=0, help="lazy steps to run under cProfile")
    ap.add_argument("--top", type=int, default=30, help="cProfile rows printed")
    a = ap.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    torch.set_num_threads(a.threads)
    torch._dynamo.config.recompile_limit = 64
    for name in a.workloads.split(","):
        bench(name, a)


if __name__ == "__main__":
    main()
