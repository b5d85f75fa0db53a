"""PyTorch's OpInfo database through both Kiln modes, checked against eager PyTorch on CPU.

For every ``op_db`` entry (float32, CPU samples): the forward and, for ops that support autograd,
the gradients (``autograd.grad`` with fixed random output gradients), in the lazy mode
(``kiln.device()`` + ``kiln.mark_step()``, every sample) and in the compile mode
(``torch.compile(..., backend="kiln")``), every sample in both.  The samples of an op
run batched (:mod:`opinfo_runner`): one Kiln run per chunk of samples serves both checks.  Rules:

- a sample whose eager run raises is skipped;
- an op listed in :mod:`opinfo_expected` that fails is ``xfail`` with its recorded reason (an op
  listed there that passes simply passes; ``bench/opinfo_report.py`` lists those);
- anything else that fails is a real failure: an error, or a wrong result (max abs diff reported);
- a result beyond ``assert_close``'s default tolerance of eager passes only when it is rounding:
  against a float64 run of the same sample (the same output gradients), its largest error is at
  most 4x eager's (``opinfo_runner.rounding_only``, the fuzzer's rule); e.g. a gradient summed
  over a broadcast dim with cancellation, added in another order.  Such samples are counted in the
  outcome (``rounded`` junit property);
- each op's samples are drawn after seeding the RNG from the op's name, so an op's inputs do not
  depend on what its worker ran before and a failure reproduces with the op alone;
- Kiln must have computed it: a pass fails when an ATen op that Kiln claims (lowered to a computing
  Kiln op: fused, kept whole or run by Kiln's executor; not a view, not in the fallback table) was
  counted as an ATen fallback, or when the op under test is such an op and no Kiln graph ran
  (``NO_GRAPH`` in opinfo_expected lists the justified exceptions);
- random ops (``RANDOM`` in opinfo_expected, or wrapped in OpInfo's ``wrapper_set_seed``) are
  checked for shapes and dtypes only; in compile mode the wrapper's ``freeze_rng_state`` (which
  Dynamo cannot trace) is left out, so the random op reaches Kiln (``opinfo_runner.compilable``);
- ``ALLOWED_FALLBACKS`` in opinfo_expected lists claimed ops an op may send through ATen, with the
  reason (data-dependent shapes in lazy mode); its values are still compared.

Workers: the ops run in ``KILN_TEST_OPINFO_WORKERS`` worker processes (:mod:`opinfo_pool`;
default the usable CPUs, at most 4; ``0``: in the test process), given the collected tests' ops
in order, so ``-k`` selects what runs; a worker that aborts (a C++ crash) fails the op it ran,
and the sweep goes on in a fresh worker.  ``KILN_TEST_OPINFO_TIMEOUT`` (s, default 600) bounds
one op.

What CI runs (``pytest -q``): every op of op_db (702) in both modes, forward and gradients; per
op at most 128 samples in lazy mode (of 19,038 samples, 18,679 run in eager; only the ~25 ops with
more are trimmed: max_pool2d and its backward have 1,440 each) and 12 in compile mode, spread
evenly over the op's list (``opinfo_runner.max_samples``): the compile sweep's cost is Dynamo's and AOTAutograd's tracing of
every sample (fake tensors, functionalization, decompositions, the partitioner), ~850 CPU-s for
every sample on the 2-core machine, too much for CI's 20 minutes beside everything else.
``KILN_TEST_OPINFO_SAMPLES=all`` runs every sample in both modes (the full sweep); ``=N`` caps
both modes at each op's N samples, spread the same way.
``KILN_TEST_OPINFO_OPS=a:b`` runs ops a..b-1 of op_db's order; ``KILN_TEST_OPINFO_CHUNK=N`` sets
how many samples share one Kiln run (default 32 lazy, 64 compile; 1: each sample alone).  Which ops fell back to ATen
(``kiln.metrics.counters()["fallbacks"]``) is recorded per test in ``FALLBACKS`` and the junit
properties, and printed by ``bench/opinfo_report.py`` (the same sweep outside pytest).
"""

from __future__ import annotations

import os
import sys
import unittest
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import kiln

sys.path.insert(0, str(Path(__file__).parent))
from opinfo_check import CHECKS, OPS  # noqa: E402
from opinfo_expected import expected_failure  # noqa: E402
from opinfo_pool import Sweep  # noqa: E402
from opinfo_runner import (  # noqa: E402
    STACK_EXTRACT_TEST_FN,
    _Error,
    compare,
    extract_test_fn,
    grad_outputs,
    kiln_results,
    rounding_only,
    samples,
)


def selected() -> list[str]:
    """Every op; ``KILN_TEST_OPINFO_OPS=a:b`` runs ops a..b-1 of op_db's order (to split a long
    run)."""
    ids = list(OPS)
    part = os.environ.get("KILN_TEST_OPINFO_OPS", "")
    if part:
        a, b = (int(v) if v else None for v in part.split(":"))
        ids = ids[a:b]
    return ids


@pytest.fixture(scope="module")
def sweep(request: pytest.FixtureRequest) -> Iterator[Sweep]:
    """The worker processes, given the ops of the collected (selected) tests in their order."""
    tasks = [
        (item.function.__name__.rsplit("_", 1)[1], item.callspec.params["name"])
        for item in request.session.items
        if item.module is sys.modules[__name__]
        and item.function.__name__ in ("test_opinfo_lazy", "test_opinfo_compile")
    ]
    s = Sweep(tasks, kiln.config.cache_dir)
    yield s
    s.close()


FALLBACKS: dict[tuple[str, str, str], dict] = {}  # (mode, check, op) -> fallbacks seen
_OUTCOMES: dict[tuple[str, str], dict] = {}  # both checks of the op being reported


def _run(sweep: Sweep, name: str, mode: str, check: str, record_property: Callable) -> None:
    if (mode, name) not in _OUTCOMES:
        _OUTCOMES.clear()
        _OUTCOMES[(mode, name)] = sweep.result(mode, name)
    out = _OUTCOMES[(mode, name)][check]
    FALLBACKS[(mode, check, name)] = out.fallbacks
    # lowered to real Kiln ops, or which ATen ops fell back (kept in the junit XML)
    record_property("kiln_fallbacks", ",".join(sorted(out.fallbacks)) or "none")
    record_property("kiln_graphs", out.kiln_graphs)
    record_property("samples", out.samples)
    record_property("rounded", out.detail if out.status == "pass" else "")
    if out.status == "skip":
        pytest.skip(out.detail)
    if out.status == "fail":
        reason = expected_failure(name, mode, check)
        if reason is not None:
            pytest.xfail(f"{reason} [got: {out.detail}]")
        pytest.fail(f"{mode} {check} {name}: {out.detail}", pytrace=False)


# op outer, check inner: the two checks of an op are adjacent and share one Kiln run
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", selected())
def test_opinfo_lazy(sweep: Sweep, name: str, check: str, record_property: Callable) -> None:
    _run(sweep, name, "lazy", check, record_property)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", selected())
def test_opinfo_compile(sweep: Sweep, name: str, check: str, record_property: Callable) -> None:
    _run(sweep, name, "compile", check, record_property)


# ---------------------------------------------------------------------------------------------
# regressions found by the sweep


def test_compile_saves_and_restores_rng_with_lazy_device_registered() -> None:
    """OpInfo's random ops save/restore the RNG of the current accelerator (kiln, once
    registered); Dynamo must not trace into kiln's get/set_rng_state (it failed with
    'you set no_dispatch() before calling into this function')."""
    from torch.testing._utils import freeze_rng_state

    kiln.device()
    torch._dynamo.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        with freeze_rng_state():
            return torch.bernoulli(x)

    x = torch.rand(3, 4)
    out = torch.compile(f, backend="kiln", fullgraph=False, dynamic=False)(x)
    assert out.shape == x.shape
    assert bool(((out == 0) | (out == 1)).all())


def test_lazy_inplace_pow_scalar_uses_matching_functional_overload() -> None:
    """``pow_.Scalar(Tensor self, Scalar exponent)`` was recorded as ``pow.Scalar(Scalar self,
    Tensor exponent)`` (same overload name, different schema) and failed; the functional variant
    must be the overload with the same arguments (``pow.Tensor_Scalar``)."""
    dev = kiln.device()
    x = torch.tensor([1.5, 2.0, -3.0])
    lx = x.to(dev)
    lx.pow_(3.0)
    kiln.mark_step()
    torch.testing.assert_close(lx.cpu(), x.pow(3.0))


def test_lazy_inplace_view_ops_change_the_tensor_geometry() -> None:
    """``unsqueeze_``/``t_``/``squeeze_`` change a tensor's shape in place: they were recorded as
    a value write of a differently shaped result ('the number of sizes provided (2) must be greater
    or equal to the number of dimensions in the tensor (3)'); torch.quantile with a 0-d q uses
    ``squeeze_`` and came back with shape [1] instead of []."""
    dev = kiln.device()
    x = torch.randn(2, 3)
    lx = x.to(dev)
    lx.unsqueeze_(0)
    assert lx.shape == (1, 2, 3)
    lx.squeeze_(0)
    lx.t_()
    y = lx * 2
    kiln.mark_step()
    assert lx.shape == (3, 2)
    torch.testing.assert_close(lx.cpu(), x.t())
    torch.testing.assert_close(y.cpu(), x.t() * 2)
    v, q = torch.randn(5), torch.tensor(0.3)
    out = torch.quantile(v.to(dev), q.to(dev))
    kiln.mark_step()
    torch.testing.assert_close(out.cpu(), torch.quantile(v, q))


def test_lazy_inplace_op_with_defaulted_argument() -> None:
    """``x.bernoulli_()`` leaves ``p`` at its default (0.5); its functional variant
    ``bernoulli.p`` has no default for ``p`` and failed ('missing value for argument p')."""
    dev = kiln.device()
    lx = torch.zeros(64).to(dev)
    lx.bernoulli_()
    kiln.mark_step()
    out = lx.cpu()
    assert bool(((out == 0) | (out == 1)).all())
    assert 0 < int(out.sum()) < 64


def test_lazy_composite_implicit_op_reaching_dispatch_is_decomposed() -> None:
    """``native_dropout_backward``'s decomposition calls ``mask.type_as(grad)``, which reaches the
    lazy device as ``aten.to.dtype_layout`` (a CompositeImplicitAutograd op) and ran eagerly,
    handing a CPU tensor to the next kiln op ('Expected all tensors to be on the same device')."""
    dev = kiln.device()
    g = torch.randn(4, 5)
    mask = torch.rand(4, 5) > 0.5
    out = torch.ops.aten.native_dropout_backward(g.to(dev), mask.to(dev), 2.0)
    kiln.mark_step()
    torch.testing.assert_close(out.cpu(), torch.ops.aten.native_dropout_backward(g, mask, 2.0))


def test_compile_takes_graphs_with_tensor_constants() -> None:
    """A tensor built inside the compiled function reaches Kiln as an fx ``get_attr`` node
    (``_tensor_constant0``); the whole graph used to fall back to ATen
    ('graph:fx node kind get_attr')."""
    torch._dynamo.reset()
    kiln.metrics.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([1.0, 2.0, 3.0]) + 1

    x = torch.randn(2, 3)
    out = torch.compile(f, backend="kiln", fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(out, f(x))
    c = kiln.metrics.counters()
    assert not [k for k in c["fallbacks"] if k.startswith("graph:")], c["fallbacks"]
    assert c.get("graphs_executed", 0) >= 1


class _ProbeCase(unittest.TestCase):
    __test__ = False  # run by the test below, not collected

    def test_probe(self) -> None:
        self.found = (extract_test_fn(), STACK_EXTRACT_TEST_FN())
        self.tracked = OPS["add"].sample_inputs("cpu", torch.float32).test_fn


def test_sweep_finds_the_test_method_as_torch_does() -> None:
    """The sweep's frame walk (in place of OpInfo's ``inspect.stack()``, ~7% of the compile
    sweep) finds the same unittest test method as torch's own, and None under pytest."""
    from torch.testing._internal import common_utils

    assert common_utils.extract_test_fn is extract_test_fn
    assert STACK_EXTRACT_TEST_FN is not extract_test_fn
    assert extract_test_fn() is None and STACK_EXTRACT_TEST_FN() is None
    case = _ProbeCase("test_probe")
    case.test_probe()
    assert case.found == (_ProbeCase.test_probe, _ProbeCase.test_probe)
    assert case.tracked is _ProbeCase.test_probe  # what OpInfo's sample iterator saw


def test_rounding_rule_tells_rounding_from_a_wrong_value() -> None:
    """A result beyond assert_close's tolerance of eager passes as rounding only when a float64
    run shows it at most ROUNDING_FACTOR times eager's error: here a sum with cancellation, where
    eager's float32 sum is 0 and the exact sum 1000."""
    from types import SimpleNamespace

    from torch.testing._internal.opinfo.core import SampleInput

    x = torch.cat([torch.full((100,), 1e8), torch.ones(1000), torch.full((100,), -1e8)])
    op, sample = SimpleNamespace(op=torch.sum), SampleInput(x)
    eager = torch.sum(x)
    assert float(eager) != 1000.0  # the premise: eager's sum is off
    exact, wrong = torch.tensor(1000.0), torch.tensor(float(eager) + 1e5)
    assert compare(exact, eager, False) is not None  # both beyond tolerance of eager
    assert compare(wrong, eager, False) is not None
    assert rounding_only(op, sample, "fwd", exact, eager)
    assert not rounding_only(op, sample, "fwd", wrong, eager)
    nan = torch.tensor(float("nan"))
    assert not rounding_only(op, sample, "fwd", nan, eager)
    # gradients: the float64 run uses the float32 run's output gradients
    w = torch.randn(5, 3, requires_grad=True)
    gsample = SampleInput(w)
    gop = SimpleNamespace(op=lambda t: t * 3.0)
    g = torch.Generator().manual_seed(1234)
    right = (torch.randn(5, 3, generator=g) * 3.0,)
    assert rounding_only(gop, gsample, "grad", right, right)
    assert not rounding_only(gop, gsample, "grad", (right[0] + 1.0,), right)


def test_lazy_to_cpu_backward_never_shows_the_engine_assert() -> None:
    """``to("cpu", torch.float64)`` of a kiln leaf (OpInfo's first ``to`` samples): where
    PyTorch's autograd engine asserts on the kiln guard's device streams ('opt_ready_stream &&
    opt_parent_stream INTERNAL ASSERT FAILED ... please report a bug to PyTorch'), kiln raises an
    error naming the fix instead; a gradient it does return equals eager's."""
    op = OPS["to"]
    for s in samples(op, 2, True):
        _, grads, _ = kiln_results("lazy", op, [s], [True])
        got = grads[0]
        if isinstance(got, _Error):
            assert "INTERNAL ASSERT" not in got.msg, got.msg
            assert "kiln: backward through a copy" in got.msg, got.msg
        else:
            x = s.input.detach().requires_grad_()
            out = x.to(*s.args, **s.kwargs)
            (want,) = torch.autograd.grad(out, [x], grad_outputs([out]))
            torch.testing.assert_close(got[0], want)
    # the gradient of the CPU output given on the kiln device: the Python recorder's tensors
    # (Python subclasses) have it moved to the CPU, where the engine's stream assert is what kiln
    # translates; the native recorder's are not subclasses, and PyTorch rejects the gradient as
    # it does for any other device.  Either way a Python error naming the problem, no assert.
    dev = kiln.device()
    for s in samples(op, 2, True):
        if not (s.args and s.args[0] == "cpu" and torch.float64 in s.args):
            continue
        x = s.input.detach().to(dev).requires_grad_()
        out = x.to(*s.args, **s.kwargs)
        g = torch.ones(out.shape, dtype=out.dtype).to(dev)
        with pytest.raises(RuntimeError) as info:
            torch.autograd.grad(out, [x], g)
        msg = str(info.value)
        assert "INTERNAL ASSERT" not in msg, msg
        assert "kiln: backward through a copy" in msg or "expected device cpu" in msg, msg
        kiln.mark_step()
