"""Smoke test of the benchmark harness (bench/run.py): a tiny workload, eager and Kiln modes, 3 steps.

Inductor's mode is left out: its cold compiles (the run's own, a fresh process's and a warm
process's) took 64 of this test's 76 s on a 2-core CI machine, and the harness compiles it
through the same ``torch.compile(step, backend=mode)`` line as Kiln's compile mode, which runs here.

Checks that the one command produces a row per mode with finite numbers, loss drift against eager,
and a JSON file, and that the eager losses it reports are those of plain PyTorch training.  Kiln
failures show up as ``error: ...`` rows in the table (that is the harness working), and fail this
test; timing is never asserted.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.report import table  # noqa: E402
from bench.workloads import WORKLOADS, build  # noqa: E402

MODES = ["eager", "kiln", "lazy"]
PARAM_MB = sum(p.numel() * 4 for p in build("mlp", True, 0).model.parameters()) / 2**20


def _eager_losses(n: int) -> list[float]:
    wl = build("mlp", quick=True, n_batches=n)
    opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3, weight_decay=0.01)
    out = []
    for batch in wl.batches:
        loss = wl.loss(wl.model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def _bench(out: Path, modes: list[str], *extra: str) -> tuple[dict, str]:
    """bench/run.py on the tiny MLP, 1 + 2 steps: (its JSON result, its stdout)."""
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "run.py"),
        "--quick",
        "--workloads",
        "mlp",
        "--modes",
        ",".join(modes),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--timeout",
        "300",  # per mode: generous, so a loaded machine does not turn into an error row
        "--json",
        str(out / "r.json"),
        "--cache-dir",
        str(out / "cache"),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "KILN_CACHE_DIR"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| workload | mode | ms/step |" in p.stdout
    return json.loads((out / "r.json").read_text()), p.stdout


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _bench(tmp_path_factory.mktemp("bench"), MODES)[0]


@pytest.mark.timeout(900)
def test_one_row_per_mode_with_finite_numbers(result: dict) -> None:
    rows = {r["mode"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(MODES)
    assert rows["eager"]["note"] is None and rows["eager"]["loss_drift"] == 0.0
    assert result["gemm_peak_gflops"] > 0 and result["workloads"]["mlp"]["gflop_per_step"] > 0
    for mode, r in rows.items():
        # the harness reports a Kiln/Inductor failure as an "error: ..." row instead of crashing;
        # here every mode must have run
        assert not (r["note"] or "").startswith("error:"), f"{mode}: {r['note']}"
        assert len(r["losses"]) == 3 and len(r["times_s"]) == 3, mode
        for key in (
            "ms_per_step",
            "speedup",
            "loss_drift",
            "mfu_pct",
            "peak_rss_mb",
            "peak_tensor_mb",
        ):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (mode, key, r[key])
        assert r["ms_per_step"] > 0 and r["peak_rss_mb"] > 0
        # at least the mode's own copy of the parameters, their gradients and AdamW's two moments
        assert r["peak_tensor_mb"] >= 4 * PARAM_MB, (mode, r["peak_tensor_mb"])
        assert set(r["rss_parts_mb"]) == {"anon", "torch", "kiln_so", "other_files"}
        assert r["loss_drift"] < 1e-3, (mode, r["losses"], rows["eager"]["losses"])
        if mode != "eager":
            assert r["compile_cold_s"] is not None and r["compile_cold_s"] >= 0


@pytest.mark.timeout(900)
def test_eager_losses_are_plain_pytorch_training(result: dict) -> None:
    eager = next(r for r in result["rows"] if r["mode"] == "eager")
    assert eager["losses"] == pytest.approx(_eager_losses(3), rel=1e-6)


def test_workloads_are_deterministic() -> None:
    for name in ("mlp", "cnn"):
        a, b = build(name, True, 2), build(name, True, 2)
        for (x1, y1), (x2, y2) in zip(a.batches, b.batches):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
        for p1, p2 in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(p1, p2)
    assert {"mlp", "gpt", "cnn", "gpt2", "bert", "llama"} <= set(WORKLOADS)


def test_table_shows_errors_in_the_row() -> None:
    row = {"workload": "mlp", "mode": "lazy", "note": "error: TimeoutError: step | took over 1s"}
    res = {
        "rows": [row],
        "workloads": {"mlp": {"desc": "MLP", "gflop_per_step": 0.5}},
        "machine": {"nproc": 2, "threads": 2, "torch": "x", "python": "3", "platform": "p"},
        "settings": {"steps": 3, "warmup": 1, "warm_steps": 2, "gemm_reps": 5},
        "gemm_peak_gflops": 50.0,
    }
    line = table(res).splitlines()[2]
    assert line.startswith("| mlp | lazy | - |") and "error: TimeoutError: step / took" in line


@pytest.mark.timeout(900)
def test_in_process_method_trains_the_same(result: dict, tmp_path: Path) -> None:
    """``--in-process`` (every mode in one process, a step each in turn) trains the same model on
    the same batches as the default (a process per mode): the same losses, step for step."""
    mine, stdout = _bench(tmp_path, ["eager", "kiln"], "--in-process")
    assert "one step each in one process" in stdout
    assert mine["settings"]["in_process"] is True and result["settings"]["in_process"] is False
    for mode in ("eager", "kiln"):
        got = next(r for r in mine["rows"] if r["mode"] == mode)
        want = next(r for r in result["rows"] if r["mode"] == mode)
        assert got["note"] is None and got["losses"] == pytest.approx(want["losses"], rel=1e-6)


def test_mode_worker_reports_a_failed_build(tmp_path: Path) -> None:
    from argparse import Namespace

    from bench.mode_worker import ModeProcess

    a = Namespace(warmup=1, steps=1, threads=1, timeout=60.0, cache_dir=str(tmp_path), quick=True)
    p = ModeProcess("eager", "no-such-workload", a)
    try:
        p.wait_ready()
        p.steps(0, 2)
    finally:
        p.close()
    assert p.error and "unknown workload 'no-such-workload'" in p.error, p.error
    assert p.times == [] and p.proc.returncode == 0
