"""PyTorch's OpInfo database through both Kiln modes, checked against eager PyTorch on CPU.

For every ``op_db`` entry (float32, CPU samples): the forward of the first samples and, for ops that
support autograd, the gradient of the first, in the lazy mode
(``kiln.device()`` + ``kiln.mark_step()``) and in the compile mode (``torch.compile(...,
backend="kiln")``).  Rules:

- a sample whose eager run raises is skipped;
- an op listed in :mod:`opinfo_expected` that fails is ``xfail`` with its recorded reason (an op
  listed there that passes simply passes; ``bench/opinfo_report.py`` lists those);
- anything else that fails is a real failure: an error, or a wrong result (max abs diff reported);
- Kiln must have computed it: a pass fails when an ATen op that Kiln claims (lowered to a computing
  Kiln op: fused, kept whole or run by Kiln's executor; not a view, not in the fallback table) was
  counted as an ATen fallback, or when the op under test is such an op and no Kiln graph ran
  (``NO_GRAPH`` in opinfo_expected lists the justified exceptions);
- random ops (``RANDOM`` in opinfo_expected, or wrapped in OpInfo's ``wrapper_set_seed``) are
  checked for shapes and dtypes only.

By default every op runs in lazy mode and every 5th in compile mode, forward on the first two
samples and gradient on the first; ``KILN_TEST_FULL_OPINFO=1`` runs every op in both modes and
``KILN_TEST_OPINFO_SAMPLES=all`` every sample.  Which ops fell back to ATen (``kiln.metrics.counters()["fallbacks"]``) is recorded per test in
``FALLBACKS`` and printed by ``bench/opinfo_report.py``.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

import kiln

sys.path.insert(0, str(Path(__file__).parent))
from opinfo_expected import NO_GRAPH, NOT_RANDOM, RANDOM, crashes, expected_failure  # noqa: E402

from kiln.ir.ops import OPS as OPS_TABLE  # noqa: E402
from kiln.ir.ops import Category  # noqa: E402
from kiln.lowering.fallback import FALLBACK as FALLBACK_TABLE  # noqa: E402

# Samples per op: the forward check runs the first FWD_SAMPLES samples and the gradient check the
# first one; KILN_TEST_OPINFO_SAMPLES=all runs every sample in both checks (19,038 forward samples
# over the 702 ops instead of 1,362: ~14x the time, a separate long run, not CI).
_N = os.environ.get("KILN_TEST_OPINFO_SAMPLES", "2")
FWD_SAMPLES: int | None = None if _N == "all" else int(_N)
GRAD_SAMPLES: int | None = None if _N == "all" else 1
# Lazy mode runs every op by default (the full sweep, ~10 min measured on a heavily loaded 2-core
# machine); compile mode runs every 5th op (Dynamo costs ~1 s per op) unless
# KILN_TEST_FULL_OPINFO=1, which runs every op in both modes.
LAZY_STRIDE, COMPILE_STRIDE = 1, 5
FULL = os.environ.get("KILN_TEST_FULL_OPINFO", "") not in ("", "0")
MODES = ("lazy", "compile")
CHECKS = ("fwd", "grad")


def op_id(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


OPS = {op_id(op): op for op in op_db}


def selected(mode: str, full: bool = FULL) -> list[str]:
    ids = list(OPS)
    if full:
        return ids
    return ids[::LAZY_STRIDE] if mode == "lazy" else ids[1::COMPILE_STRIDE]


# ---------------------------------------------------------------------------------------------
# running one sample three ways


class EagerFailed(Exception):
    """The eager reference itself raised: the sample is skipped."""


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "skip"
    detail: str = ""
    fallbacks: dict = field(default_factory=dict)
    kiln_graphs: int = 0  # graphs Kiln executed (0: nothing reached Kiln)


def is_random(name: str) -> bool:
    """Random ops: listed, or an OpInfo that wraps its op in ``wrapper_set_seed``."""
    if name in NOT_RANDOM:
        return False
    fn = OPS[name].op
    code = getattr(fn, "__code__", None)
    return name in RANDOM or (code is not None and "wrapper_set_seed" in code.co_names)


def samples(op: Any, n: int | None, requires_grad: bool) -> list[Any]:
    it = op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad)
    return list(itertools.islice(it, n))


def _leaf(t: Any, to: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(t, torch.Tensor):
        out = to(t.detach())
        if t.requires_grad and (out.is_floating_point() or out.is_complex()):
            out.requires_grad_(True)
        return out
    return t


def call_args(sample: Any, to: Callable[[torch.Tensor], torch.Tensor], dev: Any = None):
    """Fresh copies of a sample's (args, kwargs), tensors mapped through ``to``; a ``device``
    keyword naming the CPU is replaced by ``dev`` (factory ops)."""
    args = tree_map(lambda t: _leaf(t, to), (sample.input, *sample.args))
    kwargs = tree_map(lambda t: _leaf(t, to), dict(sample.kwargs))
    if dev is not None and "device" in kwargs and torch.device(kwargs["device"]).type == "cpu":
        kwargs["device"] = dev
    return args, kwargs


def _grad_parts(args: Any, kwargs: Any, out: Any) -> tuple[list, list, list[int]]:
    ins = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    flat = tree_flatten(out)[0]
    pos = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and o.requires_grad]
    return ins, [flat[i] for i in pos], pos


def _grad_outputs(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]


def run_eager(op: Any, sample: Any, check: str) -> Any:
    args, kwargs = call_args(sample, lambda t: t.clone())
    try:
        torch.manual_seed(0)
        out = op.op(*args, **kwargs)
        if check == "fwd":
            return out
        ins, outs, _ = _grad_parts(args, kwargs, out)
        if not ins or not outs:
            return None
        return torch.autograd.grad(outs, ins, _grad_outputs(outs), allow_unused=True)
    except Exception as e:  # noqa: BLE001
        raise EagerFailed(f"{type(e).__name__}: {e}") from e


def run_lazy(op: Any, sample: Any, check: str) -> Any:
    dev = kiln.device()
    args, kwargs = call_args(sample, lambda t: t.to(dev), dev)
    torch.manual_seed(0)
    out = op.op(*args, **kwargs)
    if check == "grad":
        ins, outs, _ = _grad_parts(args, kwargs, out)
        gouts = [g.to(dev) for g in _grad_outputs(outs)]
        out = torch.autograd.grad(outs, ins, gouts, allow_unused=True)
    kiln.mark_step()
    return tree_map(_to_cpu, out)


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, torch.device) and x.type == "kiln":
        return torch.device("cpu")
    return x


def run_compile(op: Any, sample: Any, check: str) -> Any:
    torch._dynamo.reset()
    args, kwargs = call_args(sample, lambda t: t.clone())
    fn = op.op

    def f(*a: Any, **k: Any) -> Any:
        return fn(*a, **k)

    cf = torch.compile(f, backend="kiln", fullgraph=False, dynamic=False)
    torch.manual_seed(0)
    out = cf(*args, **kwargs)
    if check == "grad":
        ins, outs, _ = _grad_parts(args, kwargs, out)
        out = torch.autograd.grad(outs, ins, _grad_outputs(outs), allow_unused=True)
    return tree_map(_to_cpu, out)


RUNNERS = {"lazy": run_lazy, "compile": run_compile}


# ---------------------------------------------------------------------------------------------
# comparing


def _max_abs_diff(actual: Any, expected: Any) -> str:
    diffs = []
    for a, e in zip(tree_flatten(actual)[0], tree_flatten(expected)[0]):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and a.shape == e.shape:
            if a.numel() and (a.is_floating_point() or a.is_complex()):
                d = (a.double() - e.double()).abs()
                d = torch.where(torch.isnan(a) & torch.isnan(e), 0, d)
                diffs.append(float(d.nan_to_num(float("inf")).max()))
            elif a.numel():
                diffs.append(float((a != e).sum()))
    return f"max abs diff {max(diffs):.3g}" if diffs else "structure differs"


def compare(actual: Any, expected: Any, random_op: bool) -> str | None:
    """None when equal (as eager), else a one-line description of the difference."""
    if random_op:
        fa, fe = tree_flatten(actual)[0], tree_flatten(expected)[0]
        meta = lambda xs: [
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in xs
        ]  # noqa: E731
        if meta(fa) != meta(fe):
            return f"wrong result: shapes/dtypes {meta(fa)} vs eager {meta(fe)}"
        return None
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"wrong result: {_max_abs_diff(actual, expected)} ({first})"
    return None


def _first_lines(msg: str) -> str:
    """The error's first line (and the next one when the first only introduces it)."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    out = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
    return out[:300]


def check_op(name: str, mode: str, check: str) -> Outcome:
    """Run one op (its first samples) in one mode against eager; never raises."""
    op = OPS[name]
    if check == "grad" and not op.supports_autograd:
        return Outcome("skip", "op does not support autograd")
    crash = crashes(name, mode, check)
    if crash is not None:
        return Outcome("fail", f"not run: {crash}")
    n = FWD_SAMPLES if check == "fwd" else GRAD_SAMPLES
    try:
        ss = samples(op, n, requires_grad=op.supports_autograd)
    except Exception as e:  # noqa: BLE001
        return Outcome("skip", f"sample_inputs raised {type(e).__name__}: {e}")
    _flush()
    kiln.metrics.reset()
    ran = 0
    result = Outcome("skip", "no sample ran in eager")
    for s in ss:
        try:
            expected = run_eager(op, s, check)
        except EagerFailed as e:
            result.detail = f"eager raised: {e}"
            continue
        if check == "grad" and expected is None:
            result.detail = "no differentiable inputs/outputs"
            continue
        ran += 1
        try:
            actual = RUNNERS[mode](op, s, check)
            problem = compare(actual, expected, is_random(name))
        except Exception as e:  # noqa: BLE001
            problem = f"{type(e).__name__}: {_first_lines(str(e))}"
        if problem is not None:
            result = Outcome("fail", problem)
            break
        result = Outcome("pass")
    c = kiln.metrics.counters()
    result.fallbacks = dict(c["fallbacks"])
    result.kiln_graphs = c.get("graphs_executed", 0)
    if result.status == "pass":
        claimed = sorted(f for f in result.fallbacks if kiln_computes(f))
        if claimed:
            result.status = "fail"
            result.detail = f"ops Kiln claims fell back to ATen: {claimed}"
        elif result.kiln_graphs == 0 and kiln_computes(packet(name)) and name not in NO_GRAPH:
            result.status = "fail"
            result.detail = f"no Kiln graph ran (Kiln claims {packet(name)!r})"
    return result


def kiln_computes(pkt: str) -> bool:
    """Whether Kiln claims this ATen packet: lowered to a Kiln op that computes (not a view,
    not opaque, not in the fallback table): such an op must run in a Kiln graph."""
    od = OPS_TABLE.get(pkt)
    return (
        od is not None
        and pkt not in FALLBACK_TABLE
        and od.category not in (Category.OPAQUE, Category.META, Category.VIEW)
    )


def packet(name: str) -> str:
    """The ATen packet an OpInfo op id stands for (``nn.functional.relu`` -> ``relu``,
    ``linalg.vector_norm`` -> ``linalg_vector_norm``, variants dropped)."""
    base = OPS[name].name
    for prefix, repl in (("nn.functional.", ""), ("linalg.", "linalg_"), ("special.", "special_")):
        if base.startswith(prefix):
            base = repl + base[len(prefix) :]
    return base.replace(".", "_")


def _flush() -> None:
    """Drop whatever a previous (failed) op left pending on the lazy device."""
    try:
        kiln.mark_step()
    except Exception:  # noqa: BLE001 - the previous test already reported it
        pass


# ---------------------------------------------------------------------------------------------
# the tests

FALLBACKS: dict[tuple[str, str, str], dict] = {}  # (mode, check, op) -> fallbacks seen


def _run(name: str, mode: str, check: str, record_property: Callable) -> None:
    out = check_op(name, mode, check)
    FALLBACKS[(mode, check, name)] = out.fallbacks
    # lowered to real Kiln ops, or which ATen ops fell back (kept in the junit XML)
    record_property("kiln_fallbacks", ",".join(sorted(out.fallbacks)) or "none")
    record_property("kiln_graphs", out.kiln_graphs)
    if out.status == "skip":
        pytest.skip(out.detail)
    if out.status == "fail":
        reason = expected_failure(name, mode, check)
        if reason is not None:
            pytest.xfail(f"{reason} [got: {out.detail}]")
        pytest.fail(f"{mode} {check} {name}: {out.detail}", pytrace=False)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", selected("lazy"))
def test_opinfo_lazy(name: str, check: str, record_property: Callable) -> None:
    _run(name, "lazy", check, record_property)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", selected("compile"))
def test_opinfo_compile(name: str, check: str, record_property: Callable) -> None:
    _run(name, "compile", check, record_property)


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
