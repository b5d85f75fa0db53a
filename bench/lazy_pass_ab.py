"""Same-process A/B of a Kiln pass on the lazy device: steady steps with every pass vs some off.

    KILN_LAZY_RECORDER=native python bench/lazy_pass_ab.py --workload llama \
        --disable simplify.fill_operand --steps 30

One process, one torch thread: two lazy-device variants of bench/run.py's step (forward,
backward, AdamW, zero_grad, ``mark_step``, ``loss.item()``), each with its own copy of the model
and optimizer, run step by step, alternating which goes first.  Variant ``old`` compiles with
``--disable`` added to ``KILN_DISABLE_PASSES`` (the compile cache is keyed on that set, so the
two variants' graphs are compiled and cached apart), ``new`` with every pass.  Per step: process
CPU time of the whole step, thread CPU time of the Kiln graphs it runs (``execute``); medians
after ``--warmup`` steps, printed as JSON with ``new/old``, and the load average.  On a shared
machine compare several runs; ``--disable nothing`` is the null A/B (two identical variants).
"""

from __future__ import annotations

import argparse
import copy
import json
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
from kiln.runtime import compiler

_execute = [0.0]


def _instrument() -> None:
    run = compiler.Executable.__call__

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return run(self, *args, **kwargs)
        finally:
            _execute[0] += time.thread_time() - t0

    compiler.Executable.__call__ = timed  # type: ignore[method-assign]


class Variant:
    def __init__(self, name: str, wl: Any, disable: str) -> None:
        self.name, self.disable = name, disable
        self.dev = kiln.device()
        self.step: Callable = make_step(copy.deepcopy(wl.model).to(self.dev), wl.loss, "lazy")
        self.total: list[float] = []
        self.execute: list[float] = []

    def run(self, batch: tuple, keep: bool) -> None:
        base = kiln.config.disable_passes
        kiln.config.update(disable_passes=",".join(p for p in (base, self.disable) if p))
        try:
            _execute[0] = 0.0
            c0 = time.process_time()
            loss = self.step(*(t.to(self.dev) for t in batch))
            kiln.mark_step()
            loss.item()
            c1 = time.process_time()
        finally:
            kiln.config.update(disable_passes=base)
        if keep:
            self.total.append(c1 - c0)
            self.execute.append(_execute[0])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--disable", required=True, help="passes (or pass.rule) off in 'old'")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    _instrument()
    wl = build(a.workload, False, a.warmup + a.steps)
    disable = "" if a.disable == "nothing" else a.disable
    variants = [Variant("old", wl, disable), Variant("new", wl, "")]
    for i, batch in enumerate(wl.batches[: a.warmup + a.steps]):
        for v in variants if i % 2 else variants[::-1]:
            v.run(batch, keep=i >= a.warmup)
    out: dict[str, Any] = {
        "workload": a.workload,
        "recorder": kiln.config.lazy_recorder,
        "disable": a.disable,
        "load": round(os.getloadavg()[0], 2),
    }
    for v in variants:
        out[v.name] = {
            "total_ms": round(statistics.median(v.total) * 1e3, 3),
            "execute_ms": round(statistics.median(v.execute) * 1e3, 3),
        }
    for k in ("total_ms", "execute_ms"):
        out[f"new/old {k}"] = round(out["new"][k] / out["old"][k], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
