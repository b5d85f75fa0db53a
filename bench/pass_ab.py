"""Same-process A/B of a Kiln pass: compile-mode steps with every pass vs with some switched off.

    python bench/pass_ab.py --workload gpt --disable sink_permute --steps 40 [--inductor]
    python bench/pass_ab.py --workload llama --disable cross_entropy,sink_expand,row_epilogue
    python bench/pass_ab.py --workload gpt2 --old-config recompute=0    # a config switch in old

One process, one thread (``--threads``: more, timed by wall clock): eager, Kiln (all passes), Kiln with ``--disable`` (``KILN_DISABLE_PASSES``
while it compiles; ``row_epilogue`` turns the fuser's rows epilogues off) and optionally
Inductor, each with its own copy of the workload's model and AdamW, run step by step in rotating
order; each step's thread CPU time; medians printed as
JSON with ``new/old`` (all passes / passes disabled).  Each variant's step function gets a code
object of its own (Dynamo caches compiled frames per code object) and AOTAutograd's cache is off,
so the second Kiln variant is really compiled again.  On a shared machine compare ``new/old``
across a few runs: both variants see the same load, step by step.  Run a null A/B beside it
(``--disable nothing``: two identical Kiln variants): on 2026-12-01 it still gave new/old
0.995-1.041 on GPT-2 (median 1.012 of 7), 1.023 on BERT, 1.019 on the tiny GPT: effects under
~2% are not resolved by this script.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch
import torch._functorch.config as functorch_config

import kiln
from bench.run import use_cache_dir
from bench.workloads import build
from kiln.config import from_env
from kiln.passes import row_epilogue
from kiln.runtime.compiler import clear_memory_cache
from kiln.runtime.malloc import tune_malloc


def make_step(model: torch.nn.Module, loss_fn: Callable, mode: str, tag: str) -> Callable:
    """bench/run.py's training step, its code object renamed ``tag`` (a Dynamo frame of its own)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def step(*batch: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.__code__ = step.__code__.replace(co_name=f"step_{tag}")
    return torch.compile(step, backend=mode) if mode in ("kiln", "inductor") else step


def _settings(spec: str) -> dict[str, object]:
    """``"recompute=0,..."`` as typed config values (parsed as the KILN_* variables are)."""
    if not spec:
        return {}
    env = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        env[f"KILN_{key.strip().upper()}"] = value.strip()
    parsed = from_env(env)
    return {
        part.partition("=")[0].strip(): getattr(parsed, part.partition("=")[0].strip())
        for part in spec.split(",")
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpt")
    ap.add_argument("--disable", default="", help="comma-separated passes off in 'old'")
    ap.add_argument(
        "--old-config",
        default="",
        help="comma-separated KEY=VALUE Kiln settings for 'old' only, spelled as their KILN_KEY "
        "environment variables (e.g. recompute=0)",
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; above 1 each step's wall time is measured (thread CPU time misses "
        "the other threads' work)",
    )
    a = ap.parse_args()
    old_config = _settings(a.old_config)
    if not a.disable and not old_config:
        ap.error("nothing differs between 'new' and 'old': give --disable or --old-config")
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    # Kiln's first compile sets glibc's thresholds (kiln/runtime/malloc.py): set them before any
    # model is copied, so that every variant's weights and state come from the same kind of memory.
    tune_malloc()
    use_cache_dir(tempfile.mkdtemp(prefix="kiln-pass-ab-"))
    kiln.config.update(disk_cache=False)
    functorch_config.enable_autograd_cache = False
    wl = build(a.workload, False, 1)
    batch = wl.batches[0]
    fns: dict[str, Callable] = {}
    variants = [("eager", "eager", ""), ("new", "kiln", ""), ("old", "kiln", a.disable)]
    if a.inductor:
        variants.append(("inductor", "inductor", ""))
    defaults = {k: getattr(kiln.config, k) for k in old_config}
    for name, mode, disable in variants:
        clear_memory_cache()
        kiln.config.update(disable_passes=disable, **(old_config if name == "old" else defaults))
        # not a pass: the fuser's rows epilogues (kiln/passes/row_epilogue.py), off with this name
        row_epilogue.ROW_EPILOGUE = "row_epilogue" not in disable.split(",")
        fns[name] = make_step(copy.deepcopy(wl.model), wl.loss, mode, name)
        for _ in range(a.warmup):
            fns[name](*batch).item()
    kiln.config.update(disable_passes="", **defaults)
    row_epilogue.ROW_EPILOGUE = True
    times: dict[str, list[float]] = {n: [] for n in fns}
    # Rotated each step (e n o, n o e, o e n, ...): every variant follows every other one equally
    # often and never itself.  (Alternating forward/reversed order ran "old" and "eager" twice in
    # a row at every turn and "new" never, which favoured "old" by 5-8% on GPT-2 with nothing
    # disabled: the repeated step finds its own weights and buffers in cache.)
    order = list(fns)
    for i in range(a.steps):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            t0 = clock()
            fns[name](*batch).item()
            times[name].append((clock() - t0) * 1e3)
    med = {n: round(statistics.median(v), 2) for n, v in times.items()}
    out = {"workload": a.workload, "disabled in old": a.disable, "threads": a.threads}
    out["load"] = os.getloadavg()[0]
    if old_config:
        out["config in old"] = a.old_config
    print(json.dumps({**out, **med, "new/old": round(med["new"] / med["old"], 3)}))


if __name__ == "__main__":
    main()
