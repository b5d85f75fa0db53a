"""Lazy device over changing sequence lengths: compiles and time, shape-generic graphs on vs off.

    python bench/lazy_shapes.py                # 3 interleaved repetitions of each mode
    python bench/lazy_shapes.py --reps 1 --lengths 16,24,32

The tiny GPT of ``examples/tinygpt.py`` (2 layers, d=128, batch 8) trains with AdamW on the lazy
device, one step per sequence length, in a fresh process with a fresh compile cache, once with
``KILN_DYNAMIC_SHAPES=1`` (the default: one shape-generic graph serves every length after the
first) and once with ``=0`` (one graph per length, as PyTorch/XLA).  The first step (AdamW's state)
runs at the first length before the lengths are timed.  Reported per mode, medians over the
repetitions (the modes alternate, so both see the same machine load):

  compiles      graphs compiled over the lengths (kiln.metrics)
  compile_s     seconds spent compiling them
  first_pass_s  wall time of one step per length, compiles included (process CPU time beside it)
  steady_ms     median step time of a second pass over the same lengths (nothing compiles)

Then, in one more process, the steady state side by side: both modes' graphs are compiled for
every length, and the steps alternate between them (``kiln.config.dynamic_shapes`` switched per
step, so both see the same machine load); medians of wall and process CPU time per step.
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
# bench/run.py's ten lengths for this model (dyn_lengths(64)), in a shuffled order; length 64 itself
# (the block size: the causal mask is then taken whole, not sliced) records another graph
LENGTHS = "32,16,47,21,63,37,26,58,42,53"


def _trainer():
    """In the child process: the tiny GPT on the kiln device with AdamW; ``step(length)`` runs one
    training step at that sequence length and cuts the graph."""
    sys.path.insert(0, ROOT)
    import torch

    import kiln
    from examples.tinygpt import GPT, GPTConfig

    torch.manual_seed(0)
    dev = kiln.device()
    model = GPT(GPTConfig()).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def step(length: int) -> None:
        x = torch.randint(0, 96, (8, length), generator=g)
        y = torch.randint(0, 96, (8, length), generator=g)
        model(x.to(dev), y.to(dev)).backward()
        opt.step()
        opt.zero_grad()
        kiln.mark_step()

    return kiln, step


def one_run(lengths: list[int]) -> dict:
    """In the child process: train over the lengths twice, report counters and times."""
    kiln, step = _trainer()
    metrics = kiln.metrics
    step(lengths[0])  # AdamW's state: a graph of its own
    metrics.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    for n in lengths:
        step(n)
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    c = metrics.counters()
    steady = []
    for n in lengths:
        t = time.perf_counter()
        step(n)
        steady.append(time.perf_counter() - t)
    return {
        "compiles": c.get("graphs_compiled", 0) + c.get("cache_hits_disk", 0),
        "compile_s": c["compile_s_total"],
        "first_pass_s": first,
        "first_pass_cpu_s": first_cpu,
        "steady_ms": statistics.median(steady) * 1e3,
        "generic_reuses": c.get("shape_generic_reuses", 0),
    }


def steady_ab(lengths: list[int], rounds: int) -> dict:
    """In the child process: generic vs per-length graphs, alternating step by step."""
    kiln, step = _trainer()

    for on in (True, False):  # compile both modes' graphs for every length
        kiln.config.update(dynamic_shapes=on)
        for n in lengths:
            step(n)
            step(n)
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for n in lengths:
            for on in (True, False) if r % 2 == 0 else (False, True):
                kiln.config.update(dynamic_shapes=on)
                step(n)  # the first step after a switch picks the graph
                t, c = time.perf_counter(), time.process_time()
                step(n)
                wall[on].append((time.perf_counter() - t) * 1e3)
                cpu[on].append((time.process_time() - c) * 1e3)
    return {
        f"{'on' if on else 'off'}_{k}": statistics.median(v[on])
        for on in (True, False)
        for k, v in (("wall_ms", wall), ("cpu_ms", cpu))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lengths", default=LENGTHS)
    ap.add_argument("--rounds", type=int, default=2, help="steady A/B rounds over the lengths")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = [int(s) for s in a.lengths.split(",")]
    if a.child:
        out = one_run(lengths) if a.child == "compile" else steady_ab(lengths, a.rounds)
        print(json.dumps(out))
        return
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(a.reps):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            env = dict(os.environ)
            env["KILN_DYNAMIC_SHAPES"] = "1" if mode == "on" else "0"
            env["KILN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-bench-shapes-")
            out = subprocess.run(
                [sys.executable, __file__, "--child", "compile", "--lengths", a.lengths],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"rep {r} {mode}: {results[mode][-1]}", flush=True)
    print(f"\n{len(lengths)} sequence lengths {lengths}, medians of {a.reps} interleaved runs")
    print(
        f"{'mode':<5} {'compiles':>8} {'compile_s':>10} {'first_pass_s':>13} {'cpu_s':>7} "
        f"{'steady_ms':>10}"
    )
    for mode, rs in results.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        print(
            f"{mode:<5} {med['compiles']:>8.0f} {med['compile_s']:>10.2f} "
            f"{med['first_pass_s']:>13.2f} {med['first_pass_cpu_s']:>7.2f} "
            f"{med['steady_ms']:>10.1f}"
        )
    env = dict(os.environ, KILN_CACHE_DIR=tempfile.mkdtemp(prefix="kiln-bench-shapes-"))
    cmd = [sys.executable, __file__, "--child", "steady", "--lengths", a.lengths]
    cmd += ["--rounds", str(a.rounds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    ab = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"\nsteady state, alternating step by step ({a.rounds} rounds over the lengths, medians): "
        f"generic {ab['on_wall_ms']:.1f} ms wall / {ab['on_cpu_ms']:.1f} ms CPU, "
        f"per-length {ab['off_wall_ms']:.1f} ms wall / {ab['off_cpu_ms']:.1f} ms CPU"
    )


if __name__ == "__main__":
    main()
