"""Training-step benchmark: eager vs Inductor vs Kiln compile backend vs Kiln lazy device.

    python bench/run.py                                   # every workload and mode (~10 min)
    python bench/run.py --size large                      # the larger size class
    python bench/run.py --workloads mlp,gpt --modes eager,kiln --steps 20
    python bench/run.py --quick --workloads mlp           # tiny sizes, 3 steps (smoke test)

For each workload (bench/workloads.py) it times the full training step (forward, backward, AdamW
step, zero_grad, ``loss.item()``) with each mode in a process of its own (bench/mode_worker.py: as
a user trains), interleaved in time: after the warm-up steps, rounds of ``--block`` steps per mode,
the order rotating every round (``--in-process``: every mode in this process, one step each in
turn, as before 2026-12-03).  Then a second, warm-cache process measures warm compile times and
peak memory (process RSS, and tensor memory at the allocator level: bench/tensor_memory.py), and
it prints one markdown table
(bench/report.py).  Results also go to ``bench/results.json`` (``--json PATH``).  A workload/mode
that raises or runs past ``--timeout`` seconds in one step shows ``error: ...`` in its row.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Inductor compiles in-process (no worker pool): on a 2-core machine the pool's start-up costs more
# than it saves, and its futures turn our per-step timeout into a misleading worker error.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import kiln  # noqa: E402
from bench import tensor_memory  # noqa: E402
from bench.mode_worker import ModeProcess  # noqa: E402
from bench.report import table, write_json  # noqa: E402
from bench.workloads import SIZES, WORKLOADS, Workload, build  # noqa: E402

MODES = ("eager", "inductor", "kiln", "lazy")
# bf16 column: the same steps under torch.autocast("cpu", bfloat16) (--modes ...,eager-bf16 or --bf16)
BF16_MODES = ("eager-bf16", "inductor-bf16", "kiln-bf16")
GEMM_N, GEMM_REPS = 2048, 5
MB = 2**20
# what the warm-cache child measures per (workload, mode), copied into the row
WARM_KEYS = (
    "compile_warm_s",
    "peak_rss_mb",
    "rss_parts_mb",
    "peak_tensor_mb",
    "peak_tensor_first_mb",
    "live_tensor_mb",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--size",
        choices=("small", "large", "both"),
        default="small",
        help="size class when --workloads is not given: small (default, ~10 min), large "
        "(4-layer d=256 transformers at batch 8 x seq 128, an MLP, a CNN), or both",
    )
    ap.add_argument("--workloads", default=None, help="comma list (default: those of --size)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 40)")
    ap.add_argument("--block", type=int, default=5, help="steps per mode per round (default 5)")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="every mode in this process, one step each in turn (cold caches every step)",
    )
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps, incl. the first")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps")
    ap.add_argument("--bf16", action="store_true", help="add the autocast bf16 modes")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds one step may take")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results.json"))
    ap.add_argument("--cache-dir", default=None, help="Kiln + Inductor caches (default: fresh)")
    ap.add_argument("--warm-only", action="store_true", help="internal: warm-cache subprocess")
    ap.add_argument("--pairs", default="", help="internal: workload:mode,... for --warm-only")
    a = ap.parse_args(argv)
    a.steps = a.steps if a.steps is not None else (3 if a.quick else 40)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    a.warm_steps = 2 if a.quick else 3
    if a.workloads is None:
        sizes = ("small", "large") if a.size == "both" else (a.size,)
        a.workloads = ",".join(w for sz in sizes for w in SIZES[sz])
    a.workloads = [w for w in a.workloads.split(",") if w]
    for w in a.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    a.modes = [m for m in a.modes.split(",") if m]
    if a.bf16:
        a.modes += [m for m in BF16_MODES if m not in a.modes]
    for m in a.modes:
        if m not in MODES + BF16_MODES:
            ap.error(f"unknown mode {m!r}; choose from {', '.join(MODES + BF16_MODES)}")
    return a


def use_cache_dir(path: str) -> None:
    """Point Kiln's persistent cache and Inductor's caches at folders under ``path``."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(path, "inductor")
    os.environ["KILN_CACHE_DIR"] = os.path.join(path, "kiln")
    kiln.config.update(cache_dir=os.environ["KILN_CACHE_DIR"])


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread if the block runs longer than ``seconds``."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"step took over {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = f"error: {type(e).__name__}" + (f": {text[0][:160]}" if text else "")
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, TimeoutError) and len(frames) > 1:  # where the step was stuck
        f = frames[-2]
        msg += f" (in {os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name})"
    return msg


def _rss_mb() -> float | None:
    """Current resident set size of this process, from /proc (Linux)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024
    except (OSError, StopIteration):
        return None


def rss_parts() -> dict[str, float] | None:
    """This process's resident memory (MB) by kind of mapping, from /proc/self/smaps (Linux):
    ``anon`` (heap, tensors, Python objects), ``torch`` (torch's own libraries), ``kiln_so``
    (Kiln's launcher and kernel libraries), ``other_files`` (every other mapped file)."""
    dirs = tuple(
        os.path.realpath(d) for d in (kiln.config.cache_dir, kiln.config.launcher_dir) if d
    )
    parts = {"anon": 0.0, "torch": 0.0, "kiln_so": 0.0, "other_files": 0.0}
    kind = "anon"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header
                    path = head[5].strip() if len(head) > 5 else ""
                    if not path.startswith("/"):
                        kind = "anon"
                    elif dirs and path.startswith(dirs):
                        kind = "kiln_so"
                    elif "/site-packages/torch/" in path:
                        kind = "torch"
                    else:
                        kind = "other_files"
                elif line.startswith("Rss:"):
                    parts[kind] += int(line.split()[1]) / 1024
    except OSError:
        return None
    return {k: round(v, 1) for k, v in parts.items()}


def make_step(model: torch.nn.Module, loss_fn: Callable, mode: str) -> Callable:
    """The full training step for ``mode``: forward, backward, AdamW step, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    bf16, mode = mode.endswith("-bf16"), mode.removesuffix("-bf16")

    def step(*batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if mode in ("inductor", "kiln"):
        return torch.compile(step, backend=mode)
    return step


class Runner:
    """One mode's own copy of a workload's model and optimizer, with its step times and losses."""

    def __init__(self, mode: str, wl: Workload, timeout: float) -> None:
        self.mode, self.timeout = mode, timeout
        self.times: list[float] = []
        self.losses: list[float] = []
        self.graphs = 0  # Kiln graphs compiled during this runner's steps
        self.error: str | None = None
        self.dyn: int | str | None = None  # graphs over ten sequence lengths (gpt only)
        try:
            self.dev = kiln.device() if mode == "lazy" else torch.device("cpu")
            model = copy.deepcopy(wl.model).to(self.dev)
            self.step = make_step(model, wl.loss, mode)
        except Exception as e:  # noqa: BLE001 - reported in the table
            self.error = _err(e)

    def run(self, batch: tuple[torch.Tensor, ...]) -> None:
        if self.error:
            return
        before = kiln.metrics.get("graphs_compiled")
        t0 = time.perf_counter()
        try:
            with time_limit(self.timeout):
                loss = self.step(*(t.to(self.dev) for t in batch))
                if self.mode == "lazy":
                    kiln.mark_step()
                value = loss.item()
        except Exception as e:  # noqa: BLE001 - reported in the table
            self.error = _err(e)
            return
        finally:
            self.graphs += kiln.metrics.get("graphs_compiled") - before
        self.times.append(time.perf_counter() - t0)
        self.losses.append(value)

    def steady(self, warmup: int) -> list[float]:
        """The step times the medians are taken over: those after the warm-up steps."""
        return self.times[warmup:]


def compile_s(r: Runner | ModeProcess, warmup: int) -> float | None:
    """First step minus a steady step (the median of the steps after ``warmup``)."""
    steady = r.steady(warmup)
    if r.error or not steady or r.mode.startswith("eager"):
        return None
    return max(0.0, r.times[0] - statistics.median(steady))


def gemm_peak() -> float:
    """fp32 FLOP/s of a large torch.mm on this machine (median of GEMM_REPS)."""
    a, b = torch.randn(GEMM_N, GEMM_N), torch.randn(GEMM_N, GEMM_N)
    torch.mm(a, b)
    ts = []
    for _ in range(GEMM_REPS):
        t0 = time.perf_counter()
        torch.mm(a, b)
        ts.append(time.perf_counter() - t0)
    return 2 * GEMM_N**3 / statistics.median(ts)


def step_flops(wl: Workload) -> int:
    """FLOPs of one eager training step (FlopCounterMode), on a throwaway copy of the model."""
    step = make_step(copy.deepcopy(wl.model), wl.loss, "eager")
    with FlopCounterMode(display=False) as fc:
        step(*wl.batches[0])
    return fc.get_total_flops()


def dyn_lengths(max_len: int) -> list[int]:
    """Ten distinct sequence lengths below ``max_len`` (the main run uses ``max_len`` itself)."""
    lo = max(2, max_len // 4)
    return sorted({round(lo + k * (max_len - 1 - lo) / 9) for k in range(10)})


def dynamic_graphs(wl: Workload, mode: str, timeout: float) -> int | str:
    """Kiln graphs compiled while a fresh model/step trains at 10 different sequence lengths."""
    assert wl.seq_batch is not None
    torch._dynamo.reset()
    r = Runner(mode, wl, timeout)
    for t in dyn_lengths(wl.max_len):
        r.run(wl.seq_batch(t))
    return r.error or r.graphs


def _dynamic_shapes(
    name: str, runners: dict[str, Runner] | dict[str, ModeProcess], count: Callable
) -> None:
    """On the tiny GPT, the graphs each Kiln mode compiles over ten sequence lengths."""
    for m in ("kiln", "lazy"):
        if name == "gpt" and m in runners and not runners[m].error:
            runners[m].dyn = count(m)


def _step_in_process(name: str, wl: Workload, a: argparse.Namespace) -> dict[str, Runner]:
    """Every mode in this process, one step each in turn (``--in-process``)."""
    torch._dynamo.reset()  # each workload's compiled steps start fresh (no recompile limits)
    runners = {m: Runner(m, wl, a.timeout) for m in a.modes}
    for i, batch in enumerate(wl.batches):
        k = i % len(a.modes)
        for m in a.modes[k:] + a.modes[:k]:  # rotate who goes first, so noise hits all modes
            runners[m].run(batch)
    return runners


def _step_in_workers(name: str, a: argparse.Namespace) -> dict[str, ModeProcess]:
    """Each mode in its own process: the warm-up steps mode by mode, then rounds of ``a.block``
    measured steps per mode, the order rotating each round."""
    procs = {m: ModeProcess(m, name, a) for m in a.modes}
    try:
        for p in procs.values():
            p.wait_ready()  # all built before anything is timed
        for p in procs.values():
            p.steps(0, a.warmup, measured=False)
        total = a.warmup + a.steps
        for k, start in enumerate(range(a.warmup, total, a.block)):
            j = k % len(a.modes)
            for m in a.modes[j:] + a.modes[:j]:
                procs[m].steps(start, min(start + a.block, total))
        _dynamic_shapes(name, procs, lambda m: procs[m].dyn_graphs())
    finally:
        for p in procs.values():
            p.close()
    return procs


def bench_workload(name: str, a: argparse.Namespace, peak: float) -> tuple[dict, list[dict]]:
    """Interleaved timing of every mode on one workload; returns (workload info, rows)."""
    wl = build(name, a.quick, a.warmup + a.steps)
    flops = step_flops(wl)
    if a.in_process:
        runners = _step_in_process(name, wl, a)
        _dynamic_shapes(name, runners, lambda m: dynamic_graphs(wl, m, a.timeout))
    else:
        runners = _step_in_workers(name, a)
    eager = runners.get("eager")
    eager_ms = (
        statistics.median(eager.steady(a.warmup)) * 1e3 if eager and not eager.error else None
    )
    rows = []
    for m, r in runners.items():
        ms = statistics.median(r.steady(a.warmup)) * 1e3 if not r.error else None
        drift = None
        if ms is not None and eager_ms is not None:
            drift = max(abs(x - e) / abs(e) for x, e in zip(r.losses, eager.losses))
        rows.append(
            {
                "workload": name,
                "mode": m,
                "ms_per_step": ms,
                "speedup": eager_ms / ms if ms and eager_ms else None,
                "compile_cold_s": compile_s(r, a.warmup),
                "compile_warm_s": None,
                "peak_rss_mb": None,
                "peak_tensor_mb": None,
                "loss_drift": drift,
                "mfu_pct": 100 * flops / (ms / 1e3) / peak if ms else None,
                "kiln_graphs": r.graphs if m in ("kiln", "lazy", "kiln-bf16") else None,
                "dyn_graphs": r.dyn,
                "note": r.error,
                "losses": r.losses,
                "times_s": r.times,
            }
        )
    return {"desc": wl.desc, "gflop_per_step": flops / 1e9}, rows


def warm_only(a: argparse.Namespace) -> None:
    """Fork one child per (workload, mode); each trains 1 + warm_steps steps with the warm caches
    and reports its compile time, ru_maxrss (and RSS by kind of mapping at the end) and, with the
    counting CPU allocator installed after the workload is built, the peak of tensor bytes live
    during its steady steps and during its first.  Prints one JSON object on the last line."""
    memory_error = None
    try:
        tensor_memory.load()  # built (or loaded) once, before the children fork
    except tensor_memory.Unavailable as e:
        memory_error = str(e)
    out: dict[str, Any] = {"baseline_rss_mb": _rss_mb(), "runs": [], "memory_error": memory_error}
    pairs = [tuple(p.split(":")) for p in a.pairs.split(",") if p] or [
        (w, m) for w in a.workloads for m in a.modes
    ]
    for name, m in pairs:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(rfd)
            res: dict[str, Any] = {"workload": name, "mode": m}
            try:
                wl = build(name, a.quick, 1 + a.warm_steps)
                counting = memory_error is None
                if counting:  # from here on (the model's copy, its state, every step)
                    tensor_memory.install()
                r = Runner(m, wl, a.timeout)
                peaks = []
                for batch in wl.batches:
                    if counting:
                        tensor_memory.reset_peak()
                    r.run(batch)
                    if counting:
                        peaks.append(tensor_memory.peak_bytes() / MB)
                res.update(compile_warm_s=compile_s(r, 1), error=r.error)
                if counting and not r.error:
                    res.update(
                        peak_tensor_mb=max(peaks[1:]),  # steady steps (the first compiles)
                        peak_tensor_first_mb=peaks[0],
                        live_tensor_mb=tensor_memory.live_bytes() / MB,
                    )
            except Exception as e:  # noqa: BLE001
                res["error"] = _err(e)
            res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            res["rss_parts_mb"] = rss_parts()
            os.write(wfd, json.dumps(res).encode())
            os._exit(0)
        os.close(wfd)
        with os.fdopen(rfd) as f:
            text = f.read()
        os.waitpid(pid, 0)
        out["runs"].append(
            json.loads(text)
            if text
            else {"workload": name, "mode": m, "error": "error: child died"}
        )
    print(json.dumps(out))


def run_warm(a: argparse.Namespace, pairs: list[tuple[str, str]]) -> dict:
    """bench/run.py --warm-only in a fresh process, for the (workload, mode) pairs that ran."""
    if not pairs:
        return {"runs": []}
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--warm-only",
        "--cache-dir",
        a.cache_dir,
        "--pairs",
        ",".join(f"{w}:{m}" for w, m in pairs),
        "--timeout",
        str(a.timeout),
        "--threads",
        str(a.threads),
    ] + (["--quick"] if a.quick else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout * len(pairs))
        return json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - the table still shows everything else
        return {"runs": [], "error": _err(e)}


def set_up_process(threads: int, cache_dir: str) -> None:
    """What every benchmark process sets first: its threads, Dynamo's limit, the caches."""
    torch.set_num_threads(threads)
    torch._dynamo.config.recompile_limit = 64
    use_cache_dir(cache_dir)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    a.cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="kiln-bench-cache-")
    set_up_process(a.threads, a.cache_dir)
    if a.warm_only:
        warm_only(a)
        return {}
    peak = gemm_peak()
    print(f"fp32 GEMM peak: {peak / 1e9:.1f} GFLOP/s; caches in {a.cache_dir}", flush=True)
    result: dict[str, Any] = {
        "machine": {
            "nproc": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "settings": {
            "steps": a.steps,
            "warmup": a.warmup,
            "warm_steps": a.warm_steps,
            "block": a.block,
            "in_process": a.in_process,
            "quick": a.quick,
            "timeout_s": a.timeout,
            "gemm_reps": GEMM_REPS,
        },
        "gemm_peak_gflops": peak / 1e9,
        "workloads": {},
        "rows": [],
    }
    for name in a.workloads:
        t0 = time.perf_counter()
        result["workloads"][name], rows = bench_workload(name, a, peak)
        result["rows"] += rows
        if name == "gpt":
            result["dyn_lengths"] = dyn_lengths(build(name, a.quick, 0).max_len)
        done = [f"{r['mode']} " + (r["note"] or f"{r['ms_per_step']:.1f} ms") for r in rows]
        print(f"[{name}] {time.perf_counter() - t0:.1f}s: " + "; ".join(done), flush=True)
    ok = [(r["workload"], r["mode"]) for r in result["rows"] if not r["note"]]
    warm = run_warm(a, ok)
    result["baseline_rss_mb"] = warm.get("baseline_rss_mb")
    for w in warm["runs"]:
        row = next(
            r for r in result["rows"] if (r["workload"], r["mode"]) == (w["workload"], w["mode"])
        )
        row.update({k: w.get(k) for k in WARM_KEYS})
        if w.get("error"):
            row["note"] = f"warm run {w['error']}"  # the main run of this pair had no error
    if warm.get("error"):
        print(f"warm-cache run failed: {warm['error']}")
    if warm.get("memory_error"):
        print(f"tensor memory not measured: {warm['memory_error']}")
    print()
    print(table(result))
    write_json(a.json, result)
    print(f"\nJSON: {a.json}")
    return result


if __name__ == "__main__":
    main()
