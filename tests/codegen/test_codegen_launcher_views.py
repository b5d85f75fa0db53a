"""The native launcher makes ATen view ops itself (``fast_view`` in launcher.cpp): the same values
as ATen's views and the Python executor, PyTorch's own errors for bad arguments, and graph outputs
that are views still made by ATen (their ``_base`` kept)."""

from __future__ import annotations

import pytest
import torch
from kiln_codegen_testlib import op, t

import kiln
from kiln.codegen.cpp.executor import Executor
from kiln.ir.graph import GraphBuilder, In


def _views_graph(x_shape: tuple, w_shape: tuple):
    """Every view kind of ``VIEW_KINDS`` applied to two inputs, each view read by an ATen op
    (``mul`` by 2, so that no graph output is itself a view)."""
    b = GraphBuilder()
    x = b.input(t(x_shape))  # (a, b, c)
    w = b.input(t(w_shape))  # (c, 1)
    a, bb, c = x_shape
    outs = []

    def use(v: int, shape: tuple) -> None:
        outs.append(op(b, "mul.Tensor", (v,), (In(0), 2.0), t(shape)))

    use(op(b, "view.default", (x,), (In(0), [-1, c]), t((a * bb, c))), (a * bb, c))
    use(op(b, "_unsafe_view.default", (x,), (In(0), [a, bb * c]), t((a, bb * c))), (a, bb * c))
    use(op(b, "permute.default", (x,), (In(0), [2, 0, -2]), t((c, a, bb))), (c, a, bb))
    use(op(b, "transpose.int", (x,), (In(0), -1, 0), t((c, bb, a))), (c, bb, a))
    use(op(b, "t.default", (w,), (In(0),), t((1, c))), (1, c))
    use(op(b, "unsqueeze.default", (x,), (In(0), -1), t((a, bb, c, 1))), (a, bb, c, 1))
    use(op(b, "unsqueeze.default", (x,), (In(0), 1), t((a, 1, bb, c))), (a, 1, bb, c))
    use(op(b, "squeeze.dims", (w,), (In(0), [0, -1]), t((c,))), (c,))
    use(op(b, "squeeze.dim", (w,), (In(0), 1), t((c,))), (c,))
    use(op(b, "squeeze.default", (w,), (In(0),), t((c,))), (c,))
    use(op(b, "expand.default", (w,), (In(0), [3, -1, 5]), t((3, c, 5))), (3, c, 5))
    use(op(b, "alias.default", (x,), (In(0),), t(x_shape)), x_shape)
    # a view of a view: a permuted tensor viewed where its strides allow it
    p = op(b, "permute.default", (x,), (In(0), [1, 0, 2]), t((bb, a, c)))
    use(op(b, "view.default", (p,), (In(0), [bb, a, c, 1]), t((bb, a, c, 1))), (bb, a, c, 1))
    return b.build(outs)


def _eager(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    a, bb, c = x.shape
    views = [
        x.view(-1, c),
        x.reshape(a, bb * c),
        x.permute(2, 0, -2),
        x.transpose(-1, 0),
        w.t(),
        x.unsqueeze(-1),
        x.unsqueeze(1),
        w.squeeze((0, -1)),
        w.squeeze(1),
        w.squeeze(),
        w.expand(3, -1, 5),
        x,
        x.permute(1, 0, 2).view(bb, a, c, 1),
    ]
    return [v * 2.0 for v in views]


def _mergeable(x: torch.Tensor) -> bool:
    """Whether ``x.view(-1, x.shape[-1])`` is a view (dims 0 and 1 merge)."""
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def _run(g, ins: list, views: bool, launcher: bool = True) -> tuple[Executor, list]:
    """Built with the given switches, run with grad mode off (as AOTAutograd runs its graphs)."""
    kiln.config.update(launcher_views=views, launcher=launcher)
    try:
        ex = Executor(g, {})
    finally:
        kiln.config.update(launcher_views=True, launcher=True)
    with torch.no_grad():
        return ex, ex(list(ins))


@pytest.mark.parametrize(
    "x_shape, contiguous",
    [((2, 3, 5), True), ((3, 7, 1), False), ((0, 4, 3), True), ((2, 0, 1), False)],
)
def test_native_views_agree_with_aten(x_shape, contiguous):
    torch.manual_seed(0)
    a, bb, c = x_shape
    if contiguous:
        x = torch.randn(x_shape)
    else:  # the same shape with other strides (c == 1 here keeps dims 1 and 2 mergeable)
        x = torch.randn(bb, a, c).transpose(0, 1)
        if a > 1 and bb > 1:
            assert not x.is_contiguous()
    w = torch.randn(c, 1)
    if not contiguous:
        w = torch.randn(1, c).t()  # (c, 1) with strides (1, c)
    g = _views_graph(x_shape, (c, 1))
    want = _eager_of_x = _eager(x, w) if _mergeable(x) else None
    if want is None:
        # x.view(-1, c) needs x's first two dims to merge: ATen's view raises for this layout, so
        # the graph's view falls back to reshape (a copy), as before the native views
        want = _eager(x.contiguous(), w)
    native, got = _run(g, [x, w], views=True)
    assert native.native is not None and native.native.python_nodes() == 0
    # every view but the one ATen refuses (x.view(-1, c) on a layout that cannot merge)
    n_views = 14 if want is _eager_of_x else 13
    assert native.native.views_made() == n_views
    off, aten = _run(g, [x, w], views=False)
    assert off.native.views_made() == 0
    # grad mode on: inputs that autograd made as views (x, w here when not contiguous) carry
    # autograd metadata, and their views are left to the dispatcher
    grad_on = Executor(g, {})
    with_grad = grad_on([x, w])
    if not contiguous:
        assert grad_on.native.views_made() < n_views
    _, python = _run(g, [x, w], views=True, launcher=False)
    for k, (gv, av, pv, hv, wv) in enumerate(zip(got, aten, python, with_grad, want)):
        assert gv.shape == wv.shape, k
        torch.testing.assert_close(gv, wv, rtol=0, atol=0)
        torch.testing.assert_close(gv, av, rtol=0, atol=0)
        torch.testing.assert_close(gv, pv, rtol=0, atol=0)
        torch.testing.assert_close(gv, hv, rtol=0, atol=0)


def test_bad_view_arguments_raise_pytorch_errors():
    """A permutation that repeats a dim, or an expand to an incompatible size: the launcher
    leaves them to the dispatcher, which raises PyTorch's own error (no crash, no wrong value)."""
    for name, args, shape in (
        ("permute.default", (In(0), [0, 0]), (4, 4)),
        ("expand.default", (In(0), [3, 5]), (3, 5)),
        ("view.default", (In(0), [7, -1]), (7, 2)),
    ):
        b = GraphBuilder()
        x = b.input(t((4, 3)))
        v = op(b, name, (x,), args, t(shape))
        y = op(b, "mul.Tensor", (v,), (In(0), 2.0), t(shape))
        ex = Executor(b.build([y]), {})
        assert ex.native is not None
        with pytest.raises(RuntimeError):
            ex([torch.randn(4, 3)])


def test_output_views_keep_atens_view_metadata():
    """A view that is a graph output (or reaches one through further views) is made by ATen:
    the caller sees ``_base``, as it would from the Python executor; views used only inside the
    graph are aliases made by the launcher, sharing the input's storage and version counter."""
    b = GraphBuilder()
    x = b.input(t((4, 6)))
    p = op(b, "permute.default", (x,), (In(0), [1, 0]), t((6, 4)))
    u = op(b, "unsqueeze.default", (p,), (In(0), 0), t((1, 6, 4)))  # an output through a view
    inner = op(b, "view.default", (x,), (In(0), [24]), t((24,)))
    s = op(b, "mul.Tensor", (inner,), (In(0), 3.0), t((24,)))
    ex = Executor(b.build([u, s]), {})
    xv = torch.randn(4, 6)
    out_view, scaled = ex([xv])
    assert ex.native.views_made() == 1  # the inner view only
    assert out_view._is_view() and out_view._base is xv
    assert out_view.data_ptr() == xv.data_ptr()
    torch.testing.assert_close(out_view, xv.t().unsqueeze(0), rtol=0, atol=0)
    torch.testing.assert_close(scaled, xv.view(24) * 3.0, rtol=0, atol=0)


def test_views_of_tensors_requiring_grad_under_grad_mode():
    """Grad mode on and an input that requires grad: the view must carry autograd's graph, so
    the dispatcher makes it; gradients flow as in eager."""
    b = GraphBuilder()
    x = b.input(t((3, 4)))
    p = op(b, "permute.default", (x,), (In(0), [1, 0]), t((4, 3)))
    y = op(b, "mul.Tensor", (p,), (In(0), 2.0), t((4, 3)))
    ex = Executor(b.build([y]), {})
    xv = torch.randn(3, 4, requires_grad=True)
    (got,) = ex([xv])
    assert ex.native.views_made() == 0
    assert got.requires_grad
    got.sum().backward()
    torch.testing.assert_close(xv.grad, torch.full((3, 4), 2.0), rtol=0, atol=0)
