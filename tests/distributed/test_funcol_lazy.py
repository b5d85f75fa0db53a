"""Functional collectives on the lazy device, run in 2 gloo worker processes: ``funcol.all_reduce``
without ``wait_tensor`` gives eager's result (it used to crash the process when the step ran), and
the raw op used before its wait raises a Python exception naming the fix, never a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_testlib import free_port, job_env

WORKER = str(Path(__file__).resolve().parent / "funcol_worker.py")


def _native_available() -> bool:
    from kiln.frontends.lazy import native

    return native.available()


@pytest.mark.parametrize("recorder", ["python", "native"])
def test_funcol_without_wait_on_kiln_tensors(tmp_path, recorder):
    """With either recorder of the kiln device (the native one records the functional
    collectives through its Python fallback, ``_c10d_functional`` ops looked up in their own
    namespace)."""
    if recorder == "native" and not _native_available():
        pytest.skip("native recorder unavailable")
    env = job_env(tmp_path / "cache")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env["KILN_LAZY_RECORDER"] = recorder
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=240)
        finally:
            p.kill()
        assert p.returncode == 0, f"worker exited with {p.returncode}:\n{se[-3000:]}"
        outs.append(json.loads(so))
    for o in outs:
        assert o["native"] == (recorder == "native"), o  # the recorder asked for recorded it
        # rank 0 holds [0, 1, 2, 3], rank 1 [1, 2, 3, 4]: the sum is [1, 3, 5, 7]
        assert o["funcol"] == [2.0, 6.0, 10.0, 14.0]
        assert o["waited"] == [2.0, 4.0, 6.0, 8.0]
        assert o["raw"].startswith("UnwaitedCollectiveError: Kiln: the result of"), o["raw"]
        assert "_c10d_functional::all_reduce" in o["raw"] and "wait_tensor(result)" in o["raw"]
