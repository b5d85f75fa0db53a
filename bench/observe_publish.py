"""What publishing state for ``kiln ls`` / ``kiln top`` costs a training step.

    python bench/observe_publish.py [--workload mlp] [--mode lazy|kiln] [--blocks 8] [--steps 10]

Two measurements:

1. Accounting: the step hook's cost when no record is due (one clock read and a comparison), the
   cost of one record write (gather counters and graphs, JSON, write a temporary file, rename),
   and so the cost per step = hook + write / max(1, interval / step time) as a share of the step.
2. A/B: the workload's real training step (bench/workloads.py, same model as bench/run.py), with
   publishing on and off in alternating blocks in one process; medians per setting.  On a shared
   machine the A/B difference is noise-bound: read (1) for the cost, (2) as a sanity check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import kiln
from bench.workloads import build
from kiln import metrics
from kiln.observe import hook
from kiln.observe.publish import Publisher


def _median_us(fn, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def accounting(runtime_dir: str) -> dict[str, float]:
    pub = Publisher(runtime_dir, interval_s=1.0)
    pub.write()  # first write: static info (psutil, versions), not repeated
    write_us = _median_us(pub.write, 200)
    pub._next = time.monotonic() + 3600
    tick_us = _median_us(pub.tick, 20000)
    hook_us = _median_us(hook.on_step, 20000)  # the whole observe hook, publisher not due
    pub.remove()
    tb_us = float("nan")
    try:
        from kiln.observe.tensorboard import KilnTensorBoard

        tb = KilnTensorBoard(os.path.join(runtime_dir, "tb"))
        tb_us = _median_us(tb.log_step, 2000)
        tb.close()
    except ImportError:
        pass
    return {"write_us": write_us, "tick_us": tick_us, "hook_us": hook_us, "tb_us": tb_us}


def ab(workload: str, mode: str, blocks: int, steps: int) -> dict[str, float]:
    wl = build(workload, quick=False, n_batches=steps)
    model = wl.model
    dev = None
    if mode == "lazy":
        dev = kiln.device()
        model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def step(*batch: torch.Tensor) -> None:
        loss = wl.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run = torch.compile(step, backend="kiln") if mode == "kiln" else step
    batches = [tuple(t.to(dev) for t in b) if dev else b for b in wl.batches]

    def block() -> float:
        times = []
        for b in batches:
            t0 = time.perf_counter()
            run(*b)
            if dev is not None:
                kiln.mark_step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    block()  # warm up: compile
    on, off = [], []
    for i in range(blocks):
        for publish in (True, False) if i % 2 == 0 else (False, True):
            kiln.config.update(publish=publish)
            (on if publish else off).append(block())
    kiln.config.update(publish=True)
    return {"step_on_ms": statistics.median(on) * 1e3, "step_off_ms": statistics.median(off) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="mlp")
    p.add_argument("--mode", default="lazy", choices=["lazy", "kiln"])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-run-") as d:
        kiln.config.update(runtime_dir=d)
        acc = accounting(d)
        res = ab(a.workload, a.mode, a.blocks, a.steps)
    step_s = res["step_off_ms"] / 1e3
    per_step_us = acc["hook_us"] + acc["write_us"] * min(1.0, step_s / 1.0)
    share = per_step_us / (step_s * 1e6)
    print(f"workload {a.workload} ({a.mode}), torch threads {torch.get_num_threads()}")
    print(f"  record write           {acc['write_us']:8.1f} us (median of 200)")
    print(f"  publisher tick, not due{acc['tick_us']:8.2f} us")
    print(f"  observe step hook      {acc['hook_us']:8.2f} us (everything off but publishing)")
    print(f"  TensorBoard log_step   {acc['tb_us']:8.1f} us (opt-in; 11 scalars per step)")
    print(f"  training step          {res['step_off_ms']:8.2f} ms publishing off (median)")
    print(f"                         {res['step_on_ms']:8.2f} ms publishing on  (median)")
    print(f"  publishing per step    {per_step_us:8.2f} us = {share:.4%} of a step (< 1% target)")
    print(
        f"  A/B difference         {(res['step_on_ms'] / res['step_off_ms'] - 1):+.2%} (noise-bound)"
    )
    print(f"  metrics.steps          {metrics.get('steps')}")


if __name__ == "__main__":
    main()
