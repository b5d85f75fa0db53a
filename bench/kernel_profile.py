"""Where a compiled training step's time goes, kernel by kernel: Kiln compile mode vs Inductor.

    python bench/kernel_profile.py --workloads gpt,llama --threads 1 --steps 5

For each workload (bench/workloads.py) and mode, a few warm steps run, then ``--steps`` steps under
``torch.profiler``; the table gives self CPU time per step (ms) by category (GEMM, Kiln's
generated kernels, Inductor's generated kernels, ATen views, ATen copies, other ATen) and the top
kernels of each mode by self time.  Inductor's kernels appear as ranges through its
``cpp.enable_kernel_profile`` switch; Kiln's as ``kiln::kernel <name>`` ranges (kiln.observe.ranges:
while a profiler records, the graph runs on the Python executor, whose per-call Python lands in
those ranges: a SiLU kernel of 47 us read 159 us).  So Kiln mode then runs ``--steps`` more steps
unprofiled, on its native launcher, timed node by node (kiln.observe.node_times): those are
Kiln's real kernel, GEMM and ATen times.  Kernel sources: ``--cache-dir`` keeps both
compilers' caches (Inductor's C++ under ``inductor/``, Kiln's ``kiln explain`` reports under
``explain/``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ["TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"] = "1"

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import kiln  # noqa: E402
from bench.run import Runner, use_cache_dir  # noqa: E402
from bench.workloads import build  # noqa: E402
from kiln.observe.node_times import node_times  # noqa: E402

GEMM = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::convolution",
    "aten::_flash",
    "mkldnn::_linear_pointwise",
)
VIEWS = (
    "aten::view",
    "aten::reshape",
    "aten::_unsafe_view",
    "aten::transpose",
    "aten::permute",
    "aten::t",
    "aten::expand",
    "aten::as_strided",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::split",
    "aten::alias",
    "aten::detach",
    "aten::empty",
    "aten::empty_strided",
)
COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::_to_copy")


def category(name: str) -> str | None:
    if name.startswith("kiln::kernel"):
        return "kiln kernels"
    if "cpp_fused" in name:
        return "inductor kernels"
    if name.startswith(GEMM) or "convolution" in name or "flash_attention" in name:
        return "GEMM/conv/attention"
    if name.startswith(VIEWS):
        return "ATen views/alloc"
    if name.startswith(COPIES):
        return "ATen copies"
    if name.startswith("aten::"):
        return "other ATen"
    return None


def profile_mode(name: str, mode: str, steps: int, warmup: int) -> tuple[dict, list, str]:
    torch._dynamo.reset()
    wl = build(name, False, warmup + 2 * steps)
    r = Runner(mode, wl, 300.0)
    for b in wl.batches[:warmup]:
        r.run(b)
    if r.error:
        raise RuntimeError(f"{name}/{mode}: {r.error}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in wl.batches[warmup : warmup + steps]:
            r.run(b)
    native = ""
    if mode in ("kiln", "kiln-bf16"):  # the same steps again, unprofiled, node by node
        with node_times() as nt:
            for b in wl.batches[warmup + steps :]:
                r.run(b)
        native = nt.table(steps, 25) if nt.native else "(graphs not on the native launcher)"
    if r.error:
        raise RuntimeError(f"{name}/{mode}: {r.error}")
    cats: dict[str, float] = collections.defaultdict(float)
    per: list[tuple[float, int, str]] = []
    for ev in prof.key_averages():
        c = category(ev.key)
        if c is None:
            continue
        ms = ev.self_cpu_time_total / 1e3 / steps
        cats[c] += ms
        per.append((ms, ev.count // steps, ev.key))
    cats["step (median wall)"] = sorted(r.times[warmup : warmup + steps])[steps // 2] * 1e3
    return cats, sorted(per, reverse=True), native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="gpt")
    ap.add_argument("--modes", default="eager,kiln,inductor")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--cache-dir", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cache = a.cache_dir or tempfile.mkdtemp(prefix="kiln-kprof-")
    use_cache_dir(cache)
    kiln.config.update(explain_dir=os.path.join(cache, "explain"))
    for name in a.workloads.split(","):
        res = {m: profile_mode(name, m, a.steps, a.warmup) for m in a.modes.split(",")}
        cats = sorted({c for cs, _, _ in res.values() for c in cs})
        print(f"\n## {name}: self CPU ms/step ({a.threads} thread(s), {a.steps} steps)")
        print("| category | " + " | ".join(res) + " |")
        print("|---|" + "---|" * len(res))
        for c in cats:
            print(f"| {c} | " + " | ".join(f"{res[m][0].get(c, 0.0):.2f}" for m in res) + " |")
        for m, (_, per, native) in res.items():
            print(f"\n### {name} {m}: top {a.top} by self CPU ms/step (calls/step)")
            for ms, n, key in per[: a.top]:
                print(f"  {ms:7.3f}  {n:4d}  {key[:110]}")
            if native:
                print(f"\n### {name} {m}: wall ms/step per graph node on the native launcher")
                print(native)
    print(f"\ncaches: {cache}")


if __name__ == "__main__":
    main()
