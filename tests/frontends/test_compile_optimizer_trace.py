"""A process's first compile through Kiln imports none of Inductor's compiler: Dynamo's optimizer
tracing (kiln/frontends/compile/optimizer_trace.py, which answers as torch does) and the
partitioner's CSE of the joint graph (kiln/frontends/compile/joint_cse.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from _subprocess import run_json
from torch._dynamo.variables import optimizer as dynamo_optimizer

from kiln.frontends.compile import optimizer_trace

SCRIPT = textwrap.dedent(
    """
    import copy, json, sys
    import torch, kiln

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    ref_init = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    opt, ref_opt = make(model), make(ref)

    def step(m, o, x, y):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    compiled = torch.compile(step, backend=sys.argv[1])
    before = kiln.metrics.get("graphs_compiled")
    for i in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        compiled(model, opt, x, y)
        step(ref, ref_opt, x, y)
    print(json.dumps({
        "inductor": sorted(
            m for m in ("torch._inductor.cudagraph_trees", "torch._inductor.compile_fx",
                        "torch._inductor.lowering", "torch._inductor.pattern_matcher")
            if m in sys.modules
        ),
        "graphs": kiln.metrics.get("graphs_compiled") - before,
        # fused kernels round the loss's gradient differently from ATen's (float32 ulps)
        "params_close": all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters())
        ),
        "momentum_close": all(
            torch.allclose(opt.state[a]["momentum_buffer"], ref_opt.state[b]["momentum_buffer"], rtol=1e-5, atol=1e-6)
            for a, b in zip(model.parameters(), ref.parameters())
        ),
        "params_moved": not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_init.parameters())),
    }))
    """
)


def test_a_cold_first_compile_with_an_optimizer_imports_no_inductor_compiler(tmp_path):
    out = run_json(SCRIPT, "kiln", KILN_CACHE_DIR=str(tmp_path / "cache"))
    # the optimizer's step was traced by Dynamo and compiled by Kiln (forward/backward + step),
    # the joint graph partitioned (min cut, after Kiln's CSE)
    assert out["graphs"] >= 3
    assert out["inductor"] == []
    # eager's numbers: SGD with momentum, three steps
    assert out["params_moved"] and out["params_close"] and out["momentum_close"]


def test_cpu_tensors_get_torchs_answer_cuda_tensors_go_to_torch():
    calls = []

    def original(x):
        calls.append(x)
        return False

    original.__module__ = dynamo_optimizer.__name__
    wrapped = optimizer_trace._wrap(original)
    assert wrapped(torch.zeros(2)) is True
    assert wrapped(torch.zeros(0, 3).t()) is True
    assert calls == []

    class CudaLike:
        is_cuda = True

    cuda = CudaLike()
    assert wrapped(cuda) is False
    assert calls == [cuda]


def test_installed_once_and_only_over_torchs_function(monkeypatch):
    name = "_is_static_for_cudagraphs"
    assert optimizer_trace.install()
    installed = getattr(dynamo_optimizer, name)
    torchs = installed.__kiln_wrapped__
    assert torchs.__module__ == dynamo_optimizer.__name__
    assert optimizer_trace.install() and getattr(dynamo_optimizer, name) is installed  # not nested

    monkeypatch.setattr(dynamo_optimizer, name, torchs)
    monkeypatch.setattr(torch, "__version__", "2.99.0")  # a torch whose function was not read
    assert not optimizer_trace.install()
    assert getattr(dynamo_optimizer, name) is torchs

    monkeypatch.setattr(torch, "__version__", "2.13.0")

    def someone_elses(x):
        return False

    monkeypatch.setattr(dynamo_optimizer, name, someone_elses)
    assert not optimizer_trace.install()
    assert getattr(dynamo_optimizer, name) is someone_elses


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_other_backends_trace_the_same_optimizer_step(tmp_path, backend):
    # torch's own backend in a process where Kiln's wrapper is installed (kiln.compile was
    # called first): the same step, the same eager numbers
    script = SCRIPT.replace(
        "compiled = torch.compile(step, backend=sys.argv[1])",
        "kiln.compile(lambda: None)\ncompiled = torch.compile(step, backend=sys.argv[1])",
    )
    out = run_json(script, backend, KILN_CACHE_DIR=str(tmp_path / "cache"))
    assert out["params_moved"] and out["params_close"] and out["momentum_close"]
