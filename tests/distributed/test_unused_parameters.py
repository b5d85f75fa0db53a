"""GradientSync with parameters that some ranks, or no rank, used in a step: gradients and
parameters as DistributedDataParallel(find_unused_parameters=True) gives them, and a parameter no
rank used keeps ``grad`` None (until 2026-12-06 it got zeros, and AdamW's weight decay moved it)."""

from __future__ import annotations

import math

import pytest
from dist_testlib import HERE, job_env, kiln_run, load, run


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-worker run of unused_worker.py, what rank 0 saw."""
    tmp = tmp_path_factory.mktemp("unused")
    out = tmp / "unused.json"
    cmd = kiln_run("--nproc-per-node", "2", str(HERE / "unused_worker.py"), str(out))
    p = run(cmd, job_env(tmp / "cache"), timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return load(out)


def test_unused_parameters_match_ddp(job):
    eager, lazy = job["eager"], job["lazy"]
    for step, (want, got) in enumerate(zip(eager["grads"], lazy["grads"])):
        assert want["never.weight"] is None and want["never.bias"] is None
        for name in want:
            assert (got[name] is None) == (want[name] is None), (step, name)
            if want[name] is not None:
                w, g = _flat(want[name]), _flat(got[name])
                assert max(abs(a - b) for a, b in zip(g, w)) <= 1e-6 * max(map(abs, w)), name
    for name, want in eager["params"].items():
        w, g = _flat(want), _flat(lazy["params"][name])
        assert max(abs(a - b) for a, b in zip(g, w)) <= 1e-6 * max(map(abs, w)), name


def test_ddp_finding_unused_parameters_on_the_device_names_the_fix(job):
    """Its C++ reducer pins host memory for the kiln device in backward, which PyTorch asks of
    the device's hooks: the error names GradientSync (it was PyTorch's NotImplementedError
    about registering ``PrivateUse1HooksInterface``)."""
    error = job["ddp_error"]
    assert error is not None and "find_unused_parameters=True" in error, error
    assert "kiln.distributed.GradientSync(model)" in error, error


def _flat(x: object) -> list[float]:
    if isinstance(x, list):
        return [v for item in x for v in _flat(item)]
    assert isinstance(x, float) and math.isfinite(x)
    return [x]
