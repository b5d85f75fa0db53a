"""Helpers for the distributed tests (imported by basename; not a test module)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "dp_train.py")
PY = sys.executable
STEPS = 20
REL_TOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_CACHE_DIR"] = str(cache_dir)  # a fresh cache per job: compiles are counted
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    return env


def kiln_run(*args: str) -> list[str]:
    return [PY, "-m", "kiln.tools.cli", "run", *args]


def run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def compiled_once_per_job(res: dict, cache_dir: Path) -> tuple[int, list[int], int]:
    """(graphs compiled over all ranks, graphs each rank obtained: compiled + disk-cache hits,
    graphs the job added to its cache).  A graph compiled twice in the job would make the first
    exceed the last.  (Graphs in the cache before training -- ``import kiln`` compiles a tiny
    device probe graph in every process -- are left out: dp_train.py counts them first.)"""
    ranks = res["ranks"]
    total = sum(r["metrics"].get("graphs_compiled", 0) for r in ranks)
    got = [
        r["metrics"].get("graphs_compiled", 0) + r["metrics"].get("cache_hits_disk", 0)
        for r in ranks
    ]
    added = len(list((cache_dir / "graphs").glob("*.kgc"))) - res["graphs_before"]
    return total, got, added
