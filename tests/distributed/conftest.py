from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_testlib import PY, SCRIPT, STEPS, job_env, load, run


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict:
    """The single-process run on the global batch (compile and lazy), and its checkpoint."""
    d = tmp_path_factory.mktemp("reference")
    out, ckpt = d / "ref.json", d / "ckpt"
    cmd = [PY, SCRIPT, "--modes", "compile,lazy", "--steps", str(STEPS), "--out", str(out)]
    p = run(cmd + ["--ckpt", str(ckpt)], job_env(d / "cache"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = load(out)
    ref["ckpt"] = str(ckpt)
    return ref
