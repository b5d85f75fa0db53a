"""Data-parallel throughput: 1 worker vs 2 workers (``kiln run``), compile and lazy modes.

    python bench/distributed_throughput.py                 # tiny GPT (bench/workloads.py "gpt")
    python bench/distributed_throughput.py --steps 30 --modes compile

Each configuration is one ``kiln run --nproc-per-node N`` job on this machine.  The global batch
is the same for every N (each worker takes 1/N of it), so samples/s compare directly.  With one
worker, that worker gets every core (as many torch threads); with two, each is pinned to half.
Per step: median wall time on rank 0 (after warm-up, compile excluded).  Collectives: from a
torch.profiler window of a few steps on rank 0, the summed duration of the gloo all-reduce events
(they run on gloo's thread and can overlap backward) and of the waits the step thread spent
blocked on them (``wait_tensor``; lazy mode only).  The 1-worker configurations run with all
cores (as many threads) and pinned to one core (``--cpu-list 0``, one thread).
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
sys.path.insert(0, ROOT)


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import kiln
    import kiln.distributed as kd
    from bench.workloads import build

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        kd.init_process_group()
    rank = kd.rank()
    wl = build("gpt", quick=False, n_batches=1)
    x, y = wl.batches[0]
    n = x.shape[0] // world
    x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    model = wl.model
    if a.mode == "compile":
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fwd = torch.compile(model, backend="kiln")

        def step() -> float:
            loss = fwd(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss)
    else:
        dev = kiln.device()
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if world > 1:
            kd.GradientSync(model)
        xd, yd = x.to(dev), y.to(dev)

        def step() -> float:
            loss = model(xd, yd)
            loss.backward()
            opt.step()
            opt.zero_grad()
            kiln.mark_step()
            return float(loss.cpu())

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    comm = wait = 0.0
    names: dict[str, float] = {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.profile_steps):
            step()
    for e in prof.events():
        nm = e.name
        low = nm.lower()
        if "all_reduce" in low or "allreduce" in low or "wait" in low:
            names[nm] = names.get(nm, 0.0) + e.cpu_time_total / 1e3
        if low.startswith("gloo:all_reduce"):
            comm += e.cpu_time_total / 1e3
        elif "wait_tensor" in low or low in ("c10d::wait", "aten::wait"):
            wait += e.cpu_time_total / 1e3
    if rank == 0:
        out = {
            "mode": a.mode,
            "world": world,
            "threads": torch.get_num_threads(),
            "global_batch": int(x.shape[0]) * world,
            "ms_step": statistics.median(times) * 1e3,
            "comm_ms_step": comm / a.profile_steps,
            "wait_ms_step": wait / a.profile_steps,
            "events": {k: v / a.profile_steps for k, v in names.items()},
        }
        with open(a.out, "w") as f:
            json.dump(out, f)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", default="compile")
    ap.add_argument("--modes", default="compile,lazy")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            # (workers, cores): 1 worker on the whole machine, 1 worker on one core, 2 workers
            for nproc, cpus in ((1, ""), (1, "0"), (2, "")):
                out = os.path.join(tmp, f"{mode}{nproc}{cpus}.json")
                cmd = [sys.executable, "-m", "kiln.tools.cli", "run", "--nproc-per-node"]
                cmd += [str(nproc)] + (["--cpu-list", cpus] if cpus else [])
                cmd += [os.path.abspath(__file__), "--worker", "--mode", mode]
                cmd += ["--steps", str(a.steps), "--warmup", str(a.warmup), "--out", out]
                cmd += ["--profile-steps", str(a.profile_steps)]
                p = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if p.returncode != 0:
                    print(p.stderr[-3000:], file=sys.stderr)
                    rows.append({"mode": mode, "world": nproc, "error": p.returncode})
                    continue
                with open(out) as f:
                    rows.append(json.load(f))
    print(
        "| mode | workers | threads/worker | global batch | ms/step | samples/s | vs 1 worker "
        "| gloo all-reduce ms/step | blocked waiting ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}  # the first row of a mode: 1 worker on every core
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | {r['world']} | error rc={r['error']} |")
            continue
        sps = r["global_batch"] / (r["ms_step"] / 1e3)
        # DDP's bucket waits are not profiler events of their own: only lazy mode has a number
        wait = f"{r['wait_ms_step']:.2f}" if r["mode"] == "lazy" else "-"
        base.setdefault(r["mode"], sps)
        print(
            f"| {r['mode']} | {r['world']} | {r['threads']} | {r['global_batch']} "
            f"| {r['ms_step']:.1f} | {sps:.1f} | {sps / base[r['mode']]:.2f}x "
            f"| {r['comm_ms_step']:.2f} | {wait} |"
        )
    print(json.dumps([r.get("events", {}) for r in rows], indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
