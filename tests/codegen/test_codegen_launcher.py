"""The native graph launcher runs a compiled graph as one C++ call; the Python executor stays as
the fallback (``KILN_LAUNCHER=0``, or no working compiler) and gives the same bits."""

from __future__ import annotations

import warnings

import pytest
import torch
from kiln_codegen_testlib import op, t

import kiln
from kiln import metrics
from kiln.codegen.cpp import build, launcher
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.codegen.cpp.build import BuildError
from kiln.ir.graph import GraphBuilder, In, Node, TensorType
from kiln.passes.memory_plan import memory_plan


def _graph():
    """Kernels (broadcast, a row reduction with two outputs), ATen views, a view the kernel's
    layout makes impossible (reshaped instead), a Python number input, a list argument (cat),
    a tuple result read by getitem, and an input updated in place (writeback)."""
    b = GraphBuilder()
    x = b.input(t((6, 10)))
    bias = b.input(t((10,)))
    s = b.scalar("float")
    y = op(b, "add.Tensor", (x, bias), (In(0), In(1)), t((6, 10)))
    y = op(b, "mul.Tensor", (y, s), (In(0), In(1)), t((6, 10)))
    m = op(b, "amax.default", (y,), (In(0), [-1], True), t((6, 1)))
    z = op(b, "sub.Tensor", (y, m), (In(0), In(1)), t((6, 10)))
    zt = op(b, "permute.default", (z,), (In(0), [1, 0]), t((10, 6)))
    flat = op(b, "view.default", (zt,), (In(0), [60]), t((60,)))
    c = op(b, "cat.default", (flat, bias), ([In(0), In(1)],), t((70,)))
    mx = b.add(
        Node(
            "max.dim",
            (x,),
            (In(0), 1),
            (),
            (TensorType((6,), torch.float32), TensorType((6,), torch.int64)),
        )
    )
    idx = b.add(Node("getitem", (mx,), (In(0), 1), (), (TensorType((6,), torch.int64),)))
    new_x = op(b, "mul.Tensor", (x,), (In(0), 0.5), t((6, 10)))
    b.add(Node("writeback", (x, new_x), (In(0), In(1)), (), b.nodes[x].types))
    return b.build([c, idx, m])


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(6, 10), torch.randn(10), 1.5]


def _eager(ins):
    x, bias, s = ins
    y = (x + bias) * s
    m = y.amax(-1, keepdim=True)
    c = torch.cat([(y - m).t().reshape(60), bias])
    return [c, x.max(1).indices, m]


def _run(g, launcher_on: bool):
    kiln.config.update(launcher=launcher_on)
    try:
        run, _ = build(memory_plan(fuse(g)))
    finally:
        kiln.config.update(launcher=True)
    ins = _inputs()
    outs = run(ins)
    outs2 = run(ins)  # a second run reuses the plan's buffers
    return run, ins, outs, outs2


def test_launcher_and_python_executor_agree_with_eager():
    g = _graph()
    want_ins = _inputs()
    want = _eager(want_ins)
    runs = {}
    for on in (True, False):
        run, ins, outs, outs2 = _run(g, on)
        assert (run.native is not None) is on
        for a, b in zip(outs, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(ins[0], want_ins[0] * 0.25, rtol=0, atol=0)  # halved twice
        runs[on] = outs2
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_launcher_counts_graphs_and_python_nodes():
    before = metrics.get("launcher_graphs")
    run, *_ = _run(_graph(), True)
    assert metrics.get("launcher_graphs") == before + 1
    assert run.native.python_nodes() == 0  # every node of this graph has a native form


def test_zero_size_and_non_contiguous_inputs():
    b = GraphBuilder()
    x = b.input(t((0, 7)))
    w = b.input(t((5, 3)))
    y = op(b, "exp.default", (x,), (In(0),), t((0, 7)))
    s = op(b, "sum.dim_IntList", (y,), (In(0), [0]), t((7,)))
    v = op(b, "tanh.default", (w,), (In(0),), t((5, 3)))
    g = memory_plan(fuse(b.build([s, v])))
    run, _ = build(g)
    assert run.native is not None
    wt = torch.randn(3, 5).t()  # non-contiguous
    got = run([torch.randn(0, 7), wt])
    torch.testing.assert_close(got[0], torch.zeros(7))
    torch.testing.assert_close(got[1], wt.tanh())


def test_unavailable_launcher_falls_back_with_a_warning(monkeypatch, tmp_path):
    """No working compiler: one warning naming the problem, counted, graphs still correct."""

    def no_compiler(*a, **k):
        raise BuildError("no working C++ compiler (g++): not found")

    launcher.forget()
    monkeypatch.setattr(kiln.config, "launcher_dir", str(tmp_path))
    monkeypatch.setattr(launcher, "_build", no_compiler)
    before = metrics.get("launcher_unavailable")
    try:
        with pytest.warns(RuntimeWarning, match="native graph launcher is unavailable"):
            assert not launcher.available()
        assert metrics.get("launcher_unavailable") == before + 1
        g = _graph()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per process, not per graph
            run, _ = build(memory_plan(fuse(g)))
        assert run.native is None
        want = _eager(_inputs())
        for a, b in zip(run(_inputs()), want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        launcher.forget()


def test_numbers_where_the_op_takes_a_tensor():
    """``add.Tensor(x, 0.9999)`` and ``mul.Tensor(x, <Python float input>)`` through ATen: the
    number becomes a wrapped-number tensor, as PyTorch's own op call makes it (dtype kept)."""
    from kiln.codegen.cpp.executor import Executor

    b = GraphBuilder()
    x = b.input(t((4, 3)))
    s = b.scalar("float")
    y = op(b, "add.Tensor", (x,), (In(0), 0.9999), t((4, 3)))
    z = op(b, "mul.Tensor", (y, s), (In(0), In(1)), t((4, 3)))
    ex = Executor(b.build([z]), {})  # no kernels: every node is an ATen call
    assert ex.native is not None and ex.native.python_nodes() == 0
    xv = torch.randn(4, 3)
    (got,) = ex([xv, 2.5])
    want = torch.ops.aten.mul.Tensor(torch.ops.aten.add.Tensor(xv, 0.9999), 2.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "size, viewable",
    [
        ([-1], False),  # inferred size, strides that cannot merge: reshape copies
        ([60], False),
        ([10, 2, 3], True),  # splits the last dim of a transposed tensor: a view
        ([-1, 3], False),  # regroups across both dims
        ([5, 2, 6], True),  # splits the first dim (stride 1): a view
    ],
)
def test_views_of_transposed_values_on_both_executors(size, viewable):
    """``view`` of a permuted kernel output: where the strides allow it a view of the same
    storage, otherwise reshape's copy (the launcher now decides before the call instead of
    catching ATen's error) -- eager's values on both executors."""
    b = GraphBuilder()
    x = b.input(t((6, 10)))
    y = op(b, "mul.Tensor", (x,), (In(0), 2.0), t((6, 10)))
    yt = op(b, "permute.default", (y,), (In(0), [1, 0]), t((10, 6)))
    shape = torch.empty(10, 6).view(size).shape
    v = op(b, "view.default", (yt,), (In(0), size), t(tuple(shape)))
    g = b.build([v])
    x_in = torch.randn(6, 10)
    want = (x_in * 2).t().reshape(size)
    assert _viewable(x_in.t(), size) == viewable  # the case is what it says
    for on in (True, False):
        kiln.config.update(launcher=on)
        try:
            run, _ = build(memory_plan(fuse(g)))
        finally:
            kiln.config.update(launcher=True)
        (got,) = run([x_in])
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _viewable(x: torch.Tensor, size: list[int]) -> bool:
    try:
        x.view(size)
    except RuntimeError:
        return False
    return True


def test_a_bad_view_size_still_raises_on_the_launcher():
    """A size with the wrong element count is an error (ATen's), never a silent reshape."""
    b = GraphBuilder()
    x = b.input(t((6, 10)))
    y = op(b, "mul.Tensor", (x,), (In(0), 2.0), t((6, 10)))
    yt = op(b, "permute.default", (y,), (In(0), [1, 0]), t((10, 6)))
    v = op(b, "view.default", (yt,), (In(0), [7, 9]), t((7, 9)))
    g = b.build([v])
    run, _ = build(memory_plan(fuse(g)))
    with pytest.raises(RuntimeError, match="invalid for input of size|shape"):
        run([torch.randn(6, 10)])


def test_an_extension_build_says_so_once_and_a_cached_load_is_silent(tmp_path, monkeypatch, capfd):
    """Building a C++ extension takes seconds to a minute, once per machine: the build prints
    one line naming it and where it is cached; loading the cached build prints nothing."""
    from kiln.codegen.cpp.extension import Extension
    from kiln.frontends.lazy import device_guard

    monkeypatch.setattr(kiln.config, "launcher_dir", str(tmp_path))
    src = device_guard._EXT
    ext = Extension("kiln_notice_test", src.source, src.cflags, "test extension", src.headers)
    ext.load()
    err = capfd.readouterr().err
    assert err.count("kiln: building the test extension (once per machine") == 1, err
    assert str(tmp_path) in err
    ext.forget()
    ext.load()
    assert "building" not in capfd.readouterr().err
