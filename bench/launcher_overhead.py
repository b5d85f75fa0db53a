"""Per-node launch overhead of a compiled graph: native launcher vs the Python executor.

    python bench/launcher_overhead.py                 # 500 nodes, tiny tensors
    python bench/launcher_overhead.py --blocks 250 --size 16 --reps 400

The graph chains ``--blocks`` blocks of (pointwise ``x * 1.01 + 0.5``, fused into one generated
kernel by the cpp backend) then (a ``view`` and a ``permute``, both run through ATen), on tensors
of ``--size`` x ``--size`` floats: nearly all of a run is launch overhead.  The same optimized
graph is built twice, once per executor (``config.launcher``), and the two are timed interleaved
(``--rounds`` rounds of ``--reps`` runs each); the table gives the median microseconds per run and
per node, and the time to build each (the program is prepared per graph; the launcher extension
itself is built once per machine, and its build time is printed when this run built it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import metrics  # noqa: E402
from kiln.codegen.cpp import build, launcher  # noqa: E402
from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType  # noqa: E402
from kiln.codegen.cpp import fuse_claimed as fuse  # noqa: E402
from kiln.passes.memory_plan import memory_plan  # noqa: E402


def chain_graph(blocks: int, size: int) -> Graph:
    t = TensorType((size, size), torch.float32)
    b = GraphBuilder()
    x = b.input(t)
    for _ in range(blocks):
        y = b.add(Node("mul.Tensor", (x,), (In(0), 1.01), (), (t,)))
        y = b.add(Node("add.Tensor", (y,), (In(0), 0.5), (), (t,)))
        v = b.add(
            Node(
                "view.default",
                (y,),
                (In(0), [size * size]),
                (),
                (TensorType((size * size,), torch.float32),),
            )
        )
        v = b.add(Node("view.default", (v,), (In(0), [size, size]), (), (t,)))
        x = b.add(Node("permute.default", (v,), (In(0), [1, 0]), (), (t,)))
    return b.build([x])


def timed(run, inputs, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        run(inputs)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100, help="blocks of 1 kernel + 3 ATen views")
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    launcher.load()
    built = metrics.get("launcher_builds")
    load_s = time.perf_counter() - t0
    g = memory_plan(fuse(chain_graph(a.blocks, a.size)))
    nodes = sum(1 for n in g.nodes if n.op not in ("input", "constant"))
    fused = sum(1 for n in g.nodes if n.op == "fused")
    runs = {}
    build_s = {}
    for name, on in (("python", False), ("native", True)):
        kiln.config.update(launcher=on)
        t0 = time.perf_counter()
        runs[name], _ = build(g)
        build_s[name] = time.perf_counter() - t0
    kiln.config.update(launcher=True)
    x = torch.randn(a.size, a.size)
    want = runs["python"]([x])[0]
    got = runs["native"]([x])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for k, run in runs.items():
            samples[k].append(timed(run, [x], a.reps))
    print(
        f"graph: {nodes} nodes ({fused} generated-kernel calls, {nodes - fused} ATen view ops), "
        f"{a.size}x{a.size} float32, {a.threads} thread(s); median of {a.rounds} rounds x "
        f"{a.reps} runs, executors interleaved"
    )
    print(f"launcher extension: {'built' if built else 'loaded from cache'} in {load_s:.1f} s")
    print("| executor | us/run | us/node | graph build ms |")
    print("|---|---|---|---|")
    for k, xs in samples.items():
        med = statistics.median(xs) * 1e6
        print(f"| {k} | {med:.1f} | {med / nodes:.2f} | {build_s[k] * 1e3:.1f} |")
    ratio = statistics.median(samples["python"]) / statistics.median(samples["native"])
    print(f"native launcher: {ratio:.2f}x faster per run")


if __name__ == "__main__":
    main()
