"""The OpInfo sweep's worker pool: an aborting op fails alone, and the sweep goes on."""

from __future__ import annotations

import sys
from pathlib import Path

import kiln

sys.path.insert(0, str(Path(__file__).parent))
from opinfo_pool import Sweep  # noqa: E402


def test_worker_abort_fails_its_op_and_the_sweep_continues() -> None:
    sweep = Sweep([("_abort", "abs"), ("lazy", "abs")], kiln.config.cache_dir, workers=1)
    try:
        died = sweep.result("_abort", "abs")
        assert died["fwd"].status == "fail"
        assert "worker process died (signal SIGABRT)" in died["fwd"].detail
        assert died["grad"].status == "fail"
        out = sweep.result("lazy", "abs")  # run by the fresh worker
        assert out["fwd"].status == "pass", out["fwd"].detail
        assert out["fwd"].samples >= 1 and out["fwd"].kiln_graphs > 0
        assert out["grad"].status == "pass", out["grad"].detail
    finally:
        sweep.close()
    assert sweep.procs == []
