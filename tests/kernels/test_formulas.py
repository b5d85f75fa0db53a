"""Every C++ formula and kept-whole kernel Kiln generates, against ATen, in both modes.

The cases (tests/kernels/_cases.py) cover each entry of ``kiln.codegen.cpp.ops.FORMULAS`` (each
variant: GELU 'none'/'tanh', every special-cased ``pow`` exponent, alpha/value arguments, int64
and bool operands) and the row/column and kept-whole kernels (softmax, log-softmax and layer norm,
forward and backward), on inputs spanning the float range (signed zeros, tiny, near the exp
overflow edge, huge, +-inf, NaN).  Each case runs forward, and, where it has ``grad_inputs``,
backward (``autograd.grad`` with a fixed random output gradient) on finite inputs, on the lazy
device and through ``torch.compile(backend="kiln")``.

All formula cases of one mode and check run as one Kiln graph (one C++ build); when that graph
fails as a whole, each case is rerun alone so the failure names its case.  Each kept-whole kernel
case runs alone, so an ATen fallback is attributed to its case.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import kiln
from kiln.codegen.cpp.ops import FORMULAS

sys.path.insert(0, str(Path(__file__).parent))
from _cases import CASES, KERNEL_CASES, Case  # noqa: E402

ALL = {c.name: c for c in CASES + KERNEL_CASES}
assert len(ALL) == len(CASES) + len(KERNEL_CASES), "case names must be unique"
# bench/mutation.py runs only the cases that use a mutated formula (comma-separated names)
if os.environ.get("KILN_TEST_KERNEL_CASES"):
    ALL = {n: ALL[n] for n in os.environ["KILN_TEST_KERNEL_CASES"].split(",")}
GRAD = [c.name for c in ALL.values() if c.grad_inputs is not None]

# Known wrong results, each a strict xfail with what was measured (a compiler fix removes it).
# (addcmul, lerp and tanh_backward were here until their formulas fused the multiply-add as
# ATen's CPU kernels do.)
XFAIL: dict[str, str] = {}


# (layer_norm_big_mean was here while a layer norm without weight and bias ran its backward
# through ATen, a counted fallback; the Kiln kernel takes it now.)
GRAD_XFAIL: dict[str, str] = {}


def _params(names: list[str], table: dict[str, str]) -> list:
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=table[n])) if n in table else n
        for n in names
    ]


# ATen ops allowed to run outside Kiln in these graphs (counted as fallbacks), with why.
ALLOWED_FALLBACKS: dict[str, str] = {}


def _gouts(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]


def _float_leaves(xs: tuple) -> tuple:
    return tuple(
        x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor)
        else x
        for x in xs
    )  # fmt: skip


def _grads(case: Case, xs: tuple, fn: Callable) -> tuple:
    out = [o for o in tree_flatten(fn(*xs))[0] if o.requires_grad]
    ins = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    return torch.autograd.grad(out, ins, _gouts(out), allow_unused=True)


# ---------------------------------------------------------------------------------------------
# the three ways to run a batch of cases


def run_eager(names: list[str], check: str) -> dict[str, Any]:
    out = {}
    for n in names:
        c = ALL[n]
        if check == "fwd":
            out[n] = c.fn(*c.inputs())
        else:
            out[n] = _grads(c, _float_leaves(c.grad_inputs()), c.fn)
    return out


def run_lazy(names: list[str], check: str) -> dict[str, Any]:
    dev = kiln.device()
    to = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t  # noqa: E731
    out = {}
    for n in names:
        c = ALL[n]
        if check == "fwd":
            out[n] = c.fn(*map(to, c.inputs()))
        else:
            xs = _float_leaves(tuple(map(to, c.grad_inputs())))
            outs = [o for o in tree_flatten(c.fn(*xs))[0] if o.requires_grad]
            ins = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            gouts = [g.to(dev) for g in _gouts(outs)]
            out[n] = torch.autograd.grad(outs, ins, gouts, allow_unused=True)
    kiln.mark_step()
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)


def run_compile(names: list[str], check: str) -> dict[str, Any]:
    """All cases in one compiled function (forward), and one backward graph for the gradients."""
    torch._dynamo.reset()
    cases = [ALL[n] for n in names]
    if check == "fwd":
        inputs = [c.inputs() for c in cases]
    else:
        inputs = [_float_leaves(c.grad_inputs()) for c in cases]

    def f(*per_case: tuple) -> list:
        return [c.fn(*xs) for c, xs in zip(cases, per_case)]

    outs = torch.compile(f, backend="kiln", dynamic=False)(*inputs)
    if check == "fwd":
        return dict(zip(names, outs))
    flat = [[o for o in tree_flatten(o)[0] if o.requires_grad] for o in outs]
    ins = [[x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad] for xs in inputs]
    all_outs, all_ins = sum(flat, []), sum(ins, [])
    gouts = sum([_gouts(f) for f in flat], [])
    grads = torch.autograd.grad(all_outs, all_ins, gouts, allow_unused=True)
    res, k = {}, 0
    for n, i in zip(names, ins):
        res[n] = grads[k : k + len(i)]
        k += len(i)
    return res


RUNNERS = {"lazy": run_lazy, "compile": run_compile}


# ---------------------------------------------------------------------------------------------
# one batched run per (mode, check), shared by the per-case tests

_RESULTS: dict[tuple, tuple[dict, dict, dict]] = {}
KERNEL_NAMES = {c.name for c in KERNEL_CASES}


def results(mode: str, check: str) -> tuple[dict, dict, dict]:
    """(kiln outputs, per-case errors, kiln.metrics counters) for every case of a check."""
    key = (mode, check)
    if key not in _RESULTS:
        names = list(ALL) if check == "fwd" else GRAD
        names = [n for n in names if n not in KERNEL_NAMES]
        kiln.metrics.reset()
        errors: dict[str, str] = {}
        try:
            got = RUNNERS[mode](names, check)
        except Exception:  # noqa: BLE001 - find the case(s) that break the batch
            got = {}
            for n in names:
                try:
                    got.update(RUNNERS[mode]([n], check))
                except Exception as e:  # noqa: BLE001
                    errors[n] = f"{type(e).__name__}: {str(e)[:500]}"
        _RESULTS[key] = (got, errors, kiln.metrics.counters())
    return _RESULTS[key]


_EAGER: dict[tuple[str, str], Any] = {}


def expected(check: str, name: str) -> Any:
    if (check, name) not in _EAGER:
        _EAGER[(check, name)] = run_eager([name], check)[name]
    return _EAGER[(check, name)]


def _kernel_result(name: str, mode: str, check: str) -> tuple[dict, dict, dict]:
    """A kept-whole kernel case runs alone: its fallbacks are its own."""
    key = (mode, check, name)
    if key not in _RESULTS:
        kiln.metrics.reset()
        errors: dict[str, str] = {}
        got: dict = {}
        try:
            got = RUNNERS[mode]([name], check)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
        _RESULTS[key] = (got, errors, kiln.metrics.counters())
    return _RESULTS[key]


def _check(name: str, mode: str, check: str) -> None:
    if name in KERNEL_NAMES:
        got, errors, counters = _kernel_result(name, mode, check)
    else:
        got, errors, counters = results(mode, check)
    assert name not in errors, f"{mode} {check} {name}: {errors[name]}"
    c = ALL[name]
    torch.testing.assert_close(
        got[name], expected(check, name), rtol=c.rtol, atol=c.atol, equal_nan=True,
        msg=lambda m: f"{mode} {check} {name}: {m}",
    )  # fmt: skip
    # the batch ran through Kiln, with no ATen fallback beyond the listed ones
    assert counters.get("graphs_executed", 0) >= 1, counters
    extra = set(counters["fallbacks"]) - set(ALLOWED_FALLBACKS)
    assert not extra, f"{mode} {check}: ops fell back to ATen: {sorted(extra)}"


@pytest.mark.parametrize("mode", ["lazy", "compile"])
@pytest.mark.parametrize("name", _params(list(ALL), XFAIL))
def test_forward(name: str, mode: str) -> None:
    _check(name, mode, "fwd")


@pytest.mark.parametrize("mode", ["lazy", "compile"])
@pytest.mark.parametrize("name", _params(GRAD, {**XFAIL, **GRAD_XFAIL}))
def test_backward(name: str, mode: str) -> None:
    _check(name, mode, "grad")


@pytest.mark.skipif(bool(os.environ.get("KILN_TEST_KERNEL_CASES")), reason="case subset")
def test_every_formula_has_a_case() -> None:
    covered = {f for c in CASES for f in c.formulas}
    assert set(FORMULAS) - covered == set(), "formulas without a kernel test case"
    assert covered - set(FORMULAS) == set(), "cases naming formulas that do not exist"


def test_gelu_variants_both_approximations() -> None:
    """Both GELU approximations (forward and backward) are cases, and differ from each other."""
    x = torch.linspace(-4, 4, 17)
    assert not torch.allclose(
        torch.nn.functional.gelu(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-5
    )
    assert {"gelu", "gelu_tanh", "gelu_backward", "gelu_backward_tanh"} <= set(ALL)
