"""A steady lazy step (native recorder) beside compile mode's, broken down in CPU time.

    KILN_LAZY_RECORDER=native python bench/lazy_breakdown.py --workloads gpt2,bert,llama,gpt

The step is bench/run.py's (forward, backward, AdamW, zero_grad, ``loss.item()``; the lazy device
adds ``mark_step``), on one torch thread, Kiln compile mode and the lazy device interleaved in one
process (alternating which goes first), each on its own copy of the model (``--threads``: 1 by
default).  Per mode, medians
over ``--steps`` steps of wall time (``wall``) and process CPU time (ms): ``total``; ``upload`` (the batch's ``.to``),
``step`` (the Python step: for the lazy device, recording), ``mark_step``, ``item``; and, thread
CPU time of the calling thread: ``execute`` (every Kiln graph the step runs: compile mode's
forward/backward/optimizer graphs, the lazy device's whole-step graph and any forced-sync graph),
``cut`` (the native recorder's cut) and ``peak`` (the memory statistics' sample after a native
step); ``graphs``: Kiln graphs run per step.  ``lazy/kiln``: the ratio of the totals (issue 10's
target: at most 1.05).  The machine is shared: compare ratios measured in one process, and runs
alternated with the code you compare against, never single runs.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import kiln
from bench.run import make_step
from bench.workloads import build
from kiln.frontends.lazy import native
from kiln.runtime import compiler

_acc: collections.Counter[str] = collections.Counter()


def _timed(name: str, fn: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _acc[name] += time.thread_time() - t0
            _acc["n_" + name] += 1

    return wrapped


def _instrument() -> None:
    """Time Kiln's graph runs, the native cut and the memory-statistics sample."""
    run = compiler.Executable.__call__
    compiler.Executable.__call__ = _timed("execute", run)  # type: ignore[method-assign]
    mod = native.load()
    mod.cut = _timed("cut", mod.cut)
    native.update_peak = _timed("peak", native.update_peak)


class Mode:
    def __init__(self, mode: str, wl: Any) -> None:
        self.mode = mode
        self.dev = kiln.device() if mode == "lazy" else torch.device("cpu")
        self.step = make_step(copy.deepcopy(wl.model).to(self.dev), wl.loss, mode)
        self.t: dict[str, list[float]] = collections.defaultdict(list)

    def run(self, batch: tuple, keep: bool) -> None:
        _acc.clear()
        w0 = time.perf_counter()
        c0 = time.process_time()
        xs = tuple(t.to(self.dev) for t in batch)
        c1 = time.process_time()
        loss = self.step(*xs)
        c2 = time.process_time()
        if self.mode == "lazy":
            kiln.mark_step()
        c3 = time.process_time()
        loss.item()
        c4 = time.process_time()
        w4 = time.perf_counter()
        if keep:
            for k, v in (
                ("wall", w4 - w0),
                ("total", c4 - c0),
                ("upload", c1 - c0),
                ("step", c2 - c1),
                ("mark_step", c3 - c2),
                ("item", c4 - c3),
                ("execute", _acc["execute"]),
                ("cut", _acc["cut"]),
                ("peak", _acc["peak"]),
                ("graphs", _acc["n_execute"] / 1e3),
            ):
                self.t[k].append(v)


def bench(name: str, a: argparse.Namespace) -> None:
    torch._dynamo.reset()
    wl = build(name, False, a.warmup + a.steps)
    modes = [Mode("kiln", wl), Mode("lazy", wl)]
    for i, batch in enumerate(wl.batches[: a.warmup + a.steps]):
        for m in modes if i % 2 else modes[::-1]:
            m.run(batch, keep=i >= a.warmup)
    med = {m.mode: {k: statistics.median(v) * 1e3 for k, v in m.t.items()} for m in modes}
    print(f"## {name}: {wl.desc}  (load average {os.getloadavg()[0]:.1f})")
    for m in modes:
        d = med[m.mode]
        print(
            f"  {m.mode:4s} wall {d['wall']:6.2f}  total {d['total']:6.2f}  upload {d['upload']:5.2f}  step "
            f"{d['step']:6.2f}  mark_step {d['mark_step']:6.2f}  item {d['item']:5.2f}  "
            f"execute {d['execute']:6.2f}  cut {d['cut']:5.2f}  peak {d['peak']:5.2f}  "
            f"graphs {d['graphs']:.0f}"
        )
    print(
        f"  lazy/kiln {med['lazy']['total'] / med['kiln']['total']:.3f} (CPU), "
        f"{med['lazy']['wall'] / med['kiln']['wall']:.3f} (wall)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="gpt2,bert,llama,gpt")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    if kiln.config.lazy_recorder != "native":
        raise SystemExit("run with KILN_LAZY_RECORDER=native: this breaks down the native step")
    torch.set_num_threads(a.threads)
    torch._dynamo.config.recompile_limit = 64
    _instrument()
    for name in a.workloads.split(","):
        bench(name, a)


if __name__ == "__main__":
    main()
