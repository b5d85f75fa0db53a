"""Kernels compiled in the background: the backend returns before g++ ends, the first run waits."""

from __future__ import annotations

import sys

import pytest
import torch

from kiln import metrics
from kiln.codegen.cpp.build import BuildError
from kiln.codegen.cpp.deferred import Deferred
from kiln.config import config

cbuild = sys.modules["kiln.codegen.cpp.build"]

_SRC = 'extern "C" int kiln_bg_%s(int x) { return x * %d; }\n'


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()


def test_units_land_on_wait_and_a_warm_cache_starts_nothing(fresh_cache):
    src = _SRC % ("w", 4)
    builds = metrics.get("kernel_builds")
    pending = cbuild.start_many([src])
    assert pending.running  # g++ started, not waited for
    assert metrics.get("kernel_builds") == builds  # counted when it finishes
    (lib,) = pending.wait()
    assert lib.kiln_bg_w(3) == 12
    assert metrics.get("kernel_builds") == builds + 1
    assert not list(fresh_cache.glob("kernels/.*"))  # no temporary file left
    cbuild.forget_loaded()
    again = cbuild.start_many([src])
    assert not again.running  # all hits: no process
    assert again.wait()[0].kiln_bg_w(2) == 8


def test_next_build_lands_the_previous_one_first(fresh_cache):
    first = cbuild.start_many([_SRC % ("a", 2), _SRC % ("b", 3)])
    second = cbuild.start_many([_SRC % ("c", 5)])  # needs the CPU budget: first is landed
    assert not first.running and second.running
    assert first.wait()[1].kiln_bg_b(2) == 6
    assert second.wait()[0].kiln_bg_c(2) == 10


def test_failed_gxx_raises_at_every_wait(fresh_cache):
    pending = cbuild.start_many(['extern "C" int kiln_bg_bad( { return }\n'])
    for _ in range(2):
        with pytest.raises(BuildError, match="g\\+\\+ failed for kernel unit"):
            pending.wait()
    assert not list(fresh_cache.glob("kernels/*.so"))
    assert not list(fresh_cache.glob("kernels/.*"))


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.gelu(model[0](x)) * 1.5 + 0.25
    torch._dynamo.graph_break()  # two graphs: the second is traced while the first compiles
    return (torch.tanh(model[1](h)) ** 2).sum()


def test_two_graphs_compile_while_dynamo_traces_equal_eager(fresh_cache, monkeypatch):
    made = []
    real_init = Deferred.__init__

    def spy(self, make):
        made.append(self)
        real_init(self, make)

    monkeypatch.setattr(Deferred, "__init__", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    ref = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(7, 33)
    compiled = torch.compile(_step, backend="kiln")
    loss = compiled(model, x)
    loss.backward()
    want = _step(ref, x)
    want.backward()
    assert len(made) >= 2  # forward graphs returned before their g++ finished
    torch.testing.assert_close(loss, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_gxx_failure_in_a_compiled_step_raises_a_build_error(fresh_cache, monkeypatch):
    monkeypatch.setattr(cbuild, "CXX", "false")
    monkeypatch.setattr(cbuild, "_toolchain_id", lambda: "false-compiler")
    compiled = torch.compile(lambda a: torch.sigmoid(a) * 3.0 + a, backend="kiln")
    with pytest.raises(BuildError, match="g\\+\\+ failed"):
        compiled(torch.randn(4, 5))
