"""Training steps with the native graph launcher on and off, interleaved step by step.

    python bench/launcher_steps.py --workloads mlp,gpt,llama --steps 20

For each workload (bench/workloads.py) one eager runner, one compile-mode runner and one lazy-device
runner (bench/run.py's ``Runner``: full step with AdamW) are warmed up, then every round times
eager, then each Kiln mode twice, once per executor (``config.launcher`` on / off, switched
between steps on the same compiled graphs, the order alternating per round), so machine noise hits
both executors alike.  Prints median ms per step, each variant against eager, and the launcher's
speedup over the Python executor, in wall time and in this process's CPU time per step
(``time.process_time``: less sensitive to other processes on a shared machine; with
``--threads 1`` it is the step's own compute).  (Each Kiln runner takes two optimizer steps per batch, one
per executor; timing only, no loss comparison here: tests/codegen/test_codegen_launcher.py and the
suite check results.)
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
from bench.run import Runner  # noqa: E402
from bench.workloads import build  # noqa: E402


def bench(name: str, steps: int, warmup: int, timeout: float) -> list[str]:
    torch._dynamo.reset()
    wl = build(name, False, warmup + steps)
    runners = {m: Runner(m, wl, timeout) for m in ("eager", "kiln", "lazy")}
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def timed(key: str, r: Runner, batch) -> None:
        c0 = time.process_time()
        r.run(batch)
        cpu.setdefault(key, []).append(time.process_time() - c0)
        times.setdefault(key, []).append(r.times[-1])

    for i, batch in enumerate(wl.batches):
        timed("eager", runners["eager"], batch)
        for m in ("kiln", "lazy"):
            r = runners[m]
            if r.error:
                continue
            # the same compiled graphs run under both executors: one step each, order alternating
            order = (True, False) if i % 2 else (False, True)
            for on in order:
                kiln.config.update(launcher=on)
                timed(f"{m} {'native' if on else 'python'}", r, batch)
            kiln.config.update(launcher=True)
    med = {k: statistics.median(v[warmup:]) * 1e3 for k, v in times.items()}
    mcpu = {k: statistics.median(v[warmup:]) * 1e3 for k, v in cpu.items()}
    rows = []
    for k, ms in med.items():
        rows.append(
            f"| {name} | {k} | {ms:.1f} | {med['eager'] / ms:.2f}x | {mcpu[k]:.1f} | "
            f"{mcpu['eager'] / mcpu[k]:.2f}x |"
        )
    for m in ("kiln", "lazy"):
        if f"{m} native" in med:
            py, nat = f"{m} python", f"{m} native"
            rows.append(
                f"| {name} | {m}: launcher vs Python executor | | {med[py] / med[nat]:.2f}x | "
                f"| {mcpu[py] / mcpu[nat]:.2f}x |"
            )
    for r in (runners["kiln"], runners["lazy"]):
        if r.error:
            rows.append(f"| {name} | {r.mode} | error: {r.error} | | | |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mlp,gpt,llama")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch threads: {a.threads}; medians of {a.steps} steps after {a.warmup} warm-up steps")
    print("| workload | mode | wall ms/step | vs eager | CPU ms/step | vs eager (CPU) |")
    print("|---|---|---|---|---|---|")
    for name in a.workloads.split(","):
        for row in bench(name, a.steps, a.warmup, a.timeout):
            print(row, flush=True)


if __name__ == "__main__":
    main()
