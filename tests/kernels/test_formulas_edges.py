"""Formula paths the batched kernel cases (test_formulas.py) cannot reach, each found by a
surviving mutant of ``python bench/mutation.py formulas`` (docs/mutation.md):

- ``simplify`` rewrites ``pow(x, 2)`` to ``x * x`` and ``pow(x, 1)`` to ``x`` before code
  generation, so the formula's own cases for those exponents run only with simplify switched off
  (``KILN_DISABLE_PASSES=simplify``);
- ``aten.square`` decomposes to ``pow`` and ``silu_backward`` to sigmoid arithmetic before Kiln
  sees them, so the ``square.default`` and ``silu_backward.default`` formulas (and PRELUDE's
  ``kiln_silu_bwd``) run only for a graph that holds the op (built here by hand);
- lerp switches formula at ``|weight| == 0.5`` exactly, as ATen does; at the overflow edge the
  two forms give opposite infinities;
- exp's tiny results (x below -87: subnormal, as ATen's) are below the batched cases' absolute
  tolerance, so they are compared in relative terms and bit for bit; its overflow edge is probed
  past the float range, which the batched values (100, 1e20) skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln.codegen.cpp import build
from kiln.config import config
from kiln.ir.graph import GraphBuilder, Node, TensorType
from kiln.ir.node import In
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.runtime.compiler import executables

sys.path.insert(0, str(Path(__file__).parent))
from _cases import grid, values


# these run a C++ formula through the lazy device (the hand-built graphs call the C++ backend itself)
cpp_formula = pytest.mark.needs_backend("cpp", reason="checks a generated C++ formula")


def _lazy(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn`` on the kiln device; the result, and that a generated kernel (no ATen) computed it."""
    kiln.metrics.reset()
    runs = {id(e): e.runs for e in executables()}
    out = fn(*(x.to(kiln.device()) for x in xs))
    kiln.mark_step()
    counters = kiln.metrics.counters()
    # the graph that ran (compiled now, or a shape-generic one compiled earlier) has kernels
    ran = [e for e in executables() if e.runs > runs.get(id(e), 0)]
    assert any(e.info.get("kernels") for e in ran), counters
    assert not counters["fallbacks"], counters["fallbacks"]
    return out.cpu()


@pytest.fixture
def simplify_off():
    before = config.disable_passes
    config.update(disable_passes="simplify")
    try:
        yield
    finally:
        config.update(disable_passes=before)


@cpp_formula
@pytest.mark.parametrize("e", [2, 1])
def test_pow_special_exponent_without_simplify(e, simplify_off):
    x = values(64)
    got = _lazy(lambda t: torch.ops.aten.pow.Tensor_Scalar(t, e), x)
    torch.testing.assert_close(got, torch.ops.aten.pow.Tensor_Scalar(x, e), equal_nan=True)


HAND_BUILT = {
    "square.default": (lambda: (values(64),), torch.square),
    "silu_backward.default": (grid, torch.ops.aten.silu_backward.default),
}


@pytest.mark.parametrize("op", sorted(HAND_BUILT))
def test_formula_on_a_hand_built_graph(op):
    inputs, ref = HAND_BUILT[op]
    xs = inputs()
    b = GraphBuilder()
    ins = [b.input(TensorType(tuple(x.shape), x.dtype)) for x in xs]
    args = tuple(In(k) for k in range(len(ins)))
    out = TensorType(tuple(xs[0].shape), xs[0].dtype)
    node = b.add(Node(op, tuple(ins), args, (), (out,)))
    run, info = build(fuse(b.build([node])))
    assert [k["members"] for k in info["kernels"]] == [[node]], info  # the formula, not ATen
    torch.testing.assert_close(run(list(xs))[0], ref(*xs), equal_nan=True)


@cpp_formula
def test_lerp_at_weight_one_half():
    x, e = grid()
    got = _lazy(lambda a, b: torch.ops.aten.lerp.Scalar(a, b, 0.5), x, e)
    torch.testing.assert_close(got, torch.lerp(x, e, 0.5), equal_nan=True)


@cpp_formula
def test_exp_at_the_bottom_of_its_range():
    """Kiln's exp is ATen's vectorized exp (kiln/codegen/cpp/ops.py): from -87 down its results
    are subnormal, as ATen's, down to 0 below -104; compared bit for bit with ATen's vectorized
    exp (what ``_log_softmax_backward_data`` computes with a one-hot gradient) and in relative
    terms with ``torch.exp`` above -87: the comparison's absolute tolerance (1e-5) would hide any
    tiny result."""
    x = torch.tensor([-87.0, -86.999, -86.5, -86.0, -80.0, -60.0])
    got = _lazy(torch.exp, x)
    torch.testing.assert_close(got, torch.exp(x), rtol=1e-6, atol=0.0)
    below = torch.tensor([-87.5, -88.8, -100.0, -103.9, -104.0, -104.5, -150.0, float("-inf")])
    got = _lazy(torch.exp, below)
    rows = torch.cat([torch.zeros(len(below), 1), below[:, None]], 1)
    onehot = torch.zeros_like(rows)
    onehot[:, 0] = 1.0
    aten = -torch.ops.aten._log_softmax_backward_data(onehot, rows, 1, torch.float32)[:, 1]
    assert torch.equal(got, aten + 0.0), (got, aten)
    assert (got[:4] > 0).all() and (got[-2:] == 0).all()


@cpp_formula
def test_exp_overflow_between_the_clamp_and_the_exponent_limit():
    """Kiln's exp clamps x (to 100.5) before building 2**n from exponent bits; inputs past the
    float range, below and above the clamp, give inf."""
    x = torch.tensor([88.7, 89.0, 100.0, 150.0, 176.0, 177.9, 178.0])
    got = _lazy(torch.exp, x)
    torch.testing.assert_close(got, torch.exp(x), rtol=1.3e-6, atol=1e-5)
