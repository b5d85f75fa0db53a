"""The counting CPU allocator of bench/tensor_memory.py, checked on known cases in a fresh process
(it cannot be uninstalled): exact byte counts for tensors of known size, frees, views and peaks,
and the same peak as torch.profiler's memory events over an eager training step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
import torch.nn as nn
sys.path.insert(0, sys.argv[1])
from bench import tensor_memory as tm

tm.install()
tm.install()  # idempotent
r = {}
base = tm.live_bytes()
x = torch.empty(1000, 1000)
r["empty"] = tm.live_bytes() - base
v = x[10:20].t()
r["view"] = tm.live_bytes() - base
y = torch.zeros(3, 5, dtype=torch.float64)
r["two"] = tm.live_bytes() - base
del x
r["after_del_base_of_view"] = tm.live_bytes() - base  # the view keeps the storage
del v, y
r["all_freed"] = tm.live_bytes() - base
tm.reset_peak()
t = torch.ones(256, 1024)  # 1 MiB
u = t.neg()  # 1 MiB more (no scalar operand: a number becomes a small tensor)
del t, u
r["peak"] = tm.peak_bytes() - base
r["live_after_peak"] = tm.live_bytes() - base
r["zero_size"] = (torch.empty(0, 7), tm.live_bytes() - base)[1]

# an eager training step: our peak against torch.profiler's (memory events of the same allocations)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
xb, yb = torch.randn(32, 64), torch.randint(0, 10, (32,))
def step():
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    return loss.item()
step()  # grads exist from here on: the measured step allocates nothing that outlives it
model.zero_grad(set_to_none=False)
start = tm.live_bytes()
tm.reset_peak()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
    step()
r["ours"] = tm.peak_bytes() - start
p.export_chrome_trace(sys.argv[2])
with open(sys.argv[2]) as f:
    trace = json.load(f)["traceEvents"]
# "Total Allocated": the profiler's running count of CPU bytes allocated since it started
r["profiler"] = max(
    e["args"]["Total Allocated"]
    for e in trace
    if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
)
r["active"] = tm.active()
print(json.dumps(r))
"""


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    trace = tmp_path_factory.mktemp("tensor_memory") / "trace.json"
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), str(trace)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_known_sizes_frees_and_views(counts: dict) -> None:
    assert counts["active"]
    assert counts["empty"] == 4_000_000
    assert counts["view"] == 4_000_000  # a view allocates nothing
    assert counts["two"] == 4_000_000 + 3 * 5 * 8
    assert counts["after_del_base_of_view"] == 4_000_000 + 120
    assert counts["all_freed"] == 0
    assert counts["zero_size"] == 0


def test_peak_of_a_temporary(counts: dict) -> None:
    assert counts["peak"] == 2 * 2**20
    assert counts["live_after_peak"] == 0


def test_same_peak_as_the_profiler_over_a_training_step(counts: dict) -> None:
    # the profiler sees the same allocator calls (the counting wrapper passes them through)
    assert counts["ours"] > 32 * 256 * 4  # at least the hidden activation
    assert counts["ours"] == counts["profiler"]


STEPS = r"""
import copy, json, sys
import torch
sys.path.insert(0, sys.argv[1])
import kiln
from bench import tensor_memory as tm
from bench.run import make_step
from bench.workloads import build
from kiln.codegen.cpp.executor import held_constant_bytes

torch.set_num_threads(2)
res = {}
for name in sys.argv[2].split(","):
    wl = build(name, False, 4)
    tm.install()
    for mode in ("eager", "kiln"):
        step = make_step(copy.deepcopy(wl.model), wl.loss, mode)
        peaks, between = [], []
        for batch in wl.batches:
            tm.reset_peak()
            step(*batch).item()
            peaks.append(tm.peak_bytes())
            between.append(tm.live_bytes())
        held = held_constant_bytes() if mode == "kiln" else 0
        del step
        res[f"{name}:{mode}"] = {"peak": max(peaks[1:]), "between": between[1:], "held": held}
print(json.dumps(res))
"""


def test_compile_mode_holds_no_more_tensor_memory_than_eager(tmp_path: Path) -> None:
    """Kiln compile's steady training steps (forward, backward, AdamW) on real benchmark sizes
    peak at or below eager's tensor memory (to a few scalars), and hold what eager holds between
    steps (parameters and optimizer state; no buffers kept by compiled graphs).  The CNN's backward is where
    memory-plan slots once kept dead buffers alive until the end of the graph."""
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    p = subprocess.run(
        [sys.executable, "-c", STEPS, str(ROOT), "cnn,gpt"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for name in ("cnn", "gpt"):
        eager, comp = r[f"{name}:eager"], r[f"{name}:kiln"]
        # within 256 bytes: a few 0-d temporaries of the decomposed loss (24 bytes seen on
        # the CNN) may be alive at the peak where eager's fused nll_loss has fewer
        assert comp["peak"] <= eager["peak"] + 256, (name, comp["peak"], eager["peak"])
        # between steps: the same parameters and optimizer state plus the constants the graphs
        # hold (folded values: the GPT's causal mask), give or take a few 0-d tensors; no
        # buffers (the per-graph slot arenas held ~1.7 MB on the GPT before they were given
        # back at the end of each run)
        held = comp["held"]
        assert held <= 64 * 1024, (name, held)  # the small workloads' folded values
        for c, e in zip(comp["between"], eager["between"]):
            assert abs(c - e - held) <= 256, (name, comp["between"], eager["between"], held)
