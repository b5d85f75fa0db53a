"""Whole training steps of one workload, modes interleaved step by step in one process: median
process CPU and wall ms per step (1 thread by default), for old/new tree A/B comparisons.

    python bench/step_cpu.py --workload llama --modes eager,kiln,inductor --steps 20
    python /path/to/other/tree/bench/step_cpu.py ...     # the same in another checkout

Each process uses a fresh compile cache; the last line is ``RESULT {json}`` with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

import kiln  # noqa: E402
from bench.run import Runner, use_cache_dir  # noqa: E402
from bench.workloads import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--modes", default="eager,kiln,inductor")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    use_cache_dir(tempfile.mkdtemp(prefix="kiln-step-cpu-"))
    modes = a.modes.split(",")
    wl = build(a.workload, False, a.warmup + a.steps)
    runners = {m: Runner(m, wl, 600.0) for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    wall: dict[str, list[float]] = {m: [] for m in modes}
    for k, batch in enumerate(wl.batches):
        for m in modes:
            c0, w0 = time.process_time(), time.perf_counter()
            runners[m].run(batch)
            c1, w1 = time.process_time(), time.perf_counter()
            if k >= a.warmup:
                cpu[m].append((c1 - c0) * 1e3)
                wall[m].append((w1 - w0) * 1e3)
    errors = {m: r.error for m, r in runners.items() if r.error}
    res = {
        "root": ROOT,
        "kiln": kiln.__file__,
        "load": round(os.getloadavg()[0], 2),
        "errors": errors,
        **{
            m: {
                "cpu_ms": round(statistics.median(cpu[m]), 2),
                "wall_ms": round(statistics.median(wall[m]), 2),
            }
            for m in modes
            if cpu[m]
        },
    }
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
