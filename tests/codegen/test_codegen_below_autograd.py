"""ATen calls the native launcher makes below autograd's dispatch keys (program.below_autograd):
only calls that write no input and return no view the caller gets back; views the caller gets
back stay views autograd knows (``_base``, a shared version counter), so an in-place change of a
saved value is still caught as in eager."""

from __future__ import annotations

import pytest
import torch
from kiln_codegen_testlib import op, t

from kiln.codegen.cpp import build, launcher
from kiln.codegen.cpp.program import _escaping, below_autograd
from kiln.ir.graph import GraphBuilder, In


def _graph():
    b = GraphBuilder()
    x = b.input(t((4, 6)))
    w = b.input(t((6, 3)))
    inner = op(b, "view.default", (x,), (In(0), [6, 4]), t((6, 4)))  # read only inside
    back = op(b, "view.default", (inner,), (In(0), [24]), t((24,)))  # its view is returned
    mm = op(b, "mm.default", (x, w), (In(0), In(1)), t((4, 3)))  # a fresh result
    wt = op(b, "permute.default", (w,), (In(0), [1, 0]), t((3, 6)))  # returned: a view of w
    s = op(b, "sum.default", (inner,), (In(0),), t(()))
    g = b.build([back, mm, wt, s])
    return g, {"inner": inner, "back": back, "mm": mm, "wt": wt, "s": s}


def test_which_calls_run_below_autograd():
    g, ids = _graph()
    esc = _escaping(g)
    assert {ids["back"], ids["inner"], ids["mm"], ids["wt"], ids["s"]} <= esc
    below = {k: below_autograd(g.nodes[i], i, esc) for k, i in ids.items()}
    # views the caller gets back (directly or as a view's base) keep autograd's view record;
    # fresh results (mm, sum) skip it
    assert below == {"inner": False, "back": False, "mm": True, "wt": False, "s": True}


def test_an_intermediate_view_runs_below_autograd():
    b = GraphBuilder()
    x = b.input(t((4, 6)))
    v = op(b, "view.default", (x,), (In(0), [24]), t((24,)))
    s = op(b, "sum.default", (v,), (In(0),), t(()))
    g = b.build([s])
    esc = _escaping(g)
    assert below_autograd(g.nodes[v], v, esc)
    # a mutating op never does
    b = GraphBuilder()
    x = b.input(t((4,)))
    m = op(b, "add_.Tensor", (x, x), (In(0), In(1)), t((4,)))
    g = b.build([m])
    assert not below_autograd(g.nodes[m], m, _escaping(g))


@pytest.mark.skipif(not launcher.available(), reason="needs the native launcher")
def test_returned_views_are_views_autograd_knows():
    g, _ = _graph()
    run, _ = build(g)
    x, w = torch.randn(4, 6), torch.randn(6, 3)
    back, mm, wt, s = run([x, w])
    torch.testing.assert_close(mm, x @ w)
    torch.testing.assert_close(s, x.sum())
    # eager: x.view(6, 4).view(24) and w.t() are views of the inputs
    assert back._base is x and wt._base is w
    v = w._version
    w.add_(1)
    assert wt._version == w._version == v + 1  # one version counter, as eager's view
    torch.testing.assert_close(wt, w.t())


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w.t()).square().sum()


def test_in_place_change_of_a_saved_input_is_still_caught():
    torch._dynamo.reset()
    for fn in (_step, torch.compile(_step, backend="kiln")):
        x = torch.randn(5, 4, requires_grad=True)  # x's gradient reads w (eager saves w.t())
        w = torch.randn(3, 4, requires_grad=True)
        loss = fn(x, w)
        with torch.no_grad():
            w.mul_(2)  # changes what backward reads
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
