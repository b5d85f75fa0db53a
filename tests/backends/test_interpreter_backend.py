"""The reference interpreter as a backend keeps what the C++ backend gives users beyond values:
stochastic rounding of bf16 results (``KILN_STOCHASTIC_ROUNDING=1``) and ``kiln::fallback``
ranges in profiler traces.  (The whole suite runs on it with ``KILN_BACKEND=interpreter``; these
run in every CI run, a few seconds.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.config import config
from kiln.precision import manual_seed
from kiln.runtime.compiler import executables


@pytest.fixture
def on_interpreter() -> Iterator[None]:
    saved = config.backend, config.stochastic_rounding
    config.update(backend="interpreter")
    torch._dynamo.reset()
    before = {id(e): e.runs for e in executables()}
    yield
    config.update(backend=saved[0], stochastic_rounding=saved[1])
    ran = [e for e in executables() if e.runs > before.get(id(e), 0)]
    assert ran and {e.info["backend"] for e in ran} == {"interpreter"}


def _add_chain(w: torch.Tensor) -> torch.Tensor:
    return (w.float() + 1e-3).to(torch.bfloat16)  # 1e-3 is under half of bf16's spacing at 1


@pytest.mark.parametrize("frontend", ["compile", "lazy"])
def test_stochastic_rounding_on_the_interpreter(frontend, on_interpreter):
    config.update(stochastic_rounding=True)
    manual_seed(0)
    if frontend == "compile":
        f = torch.compile(_add_chain, backend="kiln")
        w = torch.ones(4096, dtype=torch.bfloat16)
        for _ in range(100):
            w = f(w)
    else:
        w = torch.ones(4096, dtype=torch.bfloat16).to(kiln.device())
        for _ in range(100):
            w = _add_chain(w)
            kiln.mark_step()
        w = w.cpu()
    # round to nearest stays at 1.0; stochastic rounding moves 1.0 by 100 * 1e-3 on average
    assert abs(w.double().mean().item() - 1.1) < 0.01


def test_stochastic_rounding_is_reproducible_on_the_interpreter(on_interpreter):
    config.update(stochastic_rounding=True)
    f = torch.compile(lambda a, b: (a * b).to(torch.bfloat16), backend="kiln")
    a, b = torch.randn(3000), torch.randn(3000)
    manual_seed(7)
    r1 = [f(a, b).view(torch.int16) for _ in range(2)]
    manual_seed(7)
    r2 = [f(a, b).view(torch.int16) for _ in range(2)]
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    assert not torch.equal(r1[0], r1[1])  # a new key per run
    nearest = (a * b).to(torch.bfloat16)
    assert 0 < int((r1[0] != nearest.view(torch.int16)).sum()) < 3000
    # each result is one of the two bf16 neighbours of the float product
    gap = (r1[0].view(torch.bfloat16).float() - a * b).abs()
    assert bool((gap <= (a * b).abs() * 2**-7).all())


def test_fallbacks_are_profiler_ranges_on_the_interpreter(tmp_path, on_interpreter):
    def f(x: torch.Tensor) -> torch.Tensor:
        q, r = torch.linalg.qr(x)  # left to ATen: an opaque node
        return torch.tanh(q * 2 + 1).sum(0) + r.sum(1)

    cf = kiln.compile(f)
    x = torch.randn(8, 8)
    torch.testing.assert_close(cf(x), f(x))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cf(x)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = [e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]]
    assert names.count("kiln::fallback aten::linalg_qr.default") == 1
    assert any(n.startswith("kiln::graph ") for n in names)
