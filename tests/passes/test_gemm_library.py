"""The GEMM library choice (kiln/passes/gemm_library.py): which float32 GEMMs go to oneDNN, the
golden form of the rewrite, and the same values as ATen's GEMM, through the reference interpreter
and through the C++ backend (Python executor and native launcher), including operands and biases
with strides the graph did not see."""

from __future__ import annotations

import pytest
import torch
from _passes_testlib import capture

from kiln.codegen.interpreter import Interpreter
from kiln.config import config
from kiln.ir import verify
from kiln.passes.gemm_library import OP, available, gemm_library
from kiln.runtime.compiler import clear_memory_cache, compile_graph
from kiln.runtime.gemm_epilogues import gemm_epilogues

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN")


def _ops(g) -> list[str]:
    return [n.op for n in g.nodes if n.op not in ("input", "constant")]


def _rows(x):
    """``x`` copied contiguous: a left operand whose layout the graph knows (a graph input's it
    does not: it may arrive transposed)."""
    return x.clone(memory_format=torch.contiguous_format)


def _linear(x, w, b):
    return torch.addmm(b, _rows(x), w.t())


def _mm(a, b):
    return torch.mm(_rows(a), b)


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # oneDNN sums in another order than MKL: a few ulp of the largest |product| sum
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=4e-7 * max(scale, 1e-30) * max(k, 1) ** 0.5)


def test_linear_becomes_one_onednn_call_on_the_weight_itself():
    x, w, b = torch.randn(512, 256), torch.randn(384, 256), torch.randn(384)
    g = capture(_linear, x, w, b)
    out = verify(gemm_library(g))
    # the weight is read as it is (its transpose, read by nothing else, is dropped); the bias (a
    # graph input) through `contiguous`, which returns it unchanged when it already is
    assert _ops(g) == ["clone.default", "permute.default", "addmm.default"]
    assert _ops(out) == ["clone.default", "contiguous.default", OP]
    lp = next(n for n in out.nodes if n.op == OP)
    assert out.nodes[lp.inputs[1]].op == "input"
    assert lp.args[3:] == ("none", [], "")
    got = Interpreter(out)([x, w, b])[0]
    _close(got, torch.addmm(b, x, w.t()), 256)
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""))


def test_explain_names_the_library():
    x, w, b = torch.randn(512, 256), torch.randn(384, 256), torch.randn(384)
    (rec,) = gemm_epilogues(verify(gemm_library(capture(_linear, x, w, b))))
    assert rec["op"] == OP and rec["fused"] == "bias (oneDNN)"
    assert rec["library"].startswith("oneDNN inner product")
    (rec,) = gemm_epilogues(capture(_mm, torch.randn(128, 128), torch.randn(128, 128)))
    assert rec["library"] == "ATen (MKL sgemm for float32)"


@pytest.mark.parametrize("shape", [(512, 128, 512), (512, 10, 2048), (128, 10, 512)])
def test_mm_of_a_row_major_left_operand(shape):
    """Over 2^24 multiply-adds, or a short reduction into a wide output (a classifier's input
    gradient: 2^20 and 2^19.3 multiply-adds)."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = verify(gemm_library(capture(_mm, a, b)))
    assert _ops(out) == ["clone.default", "t.default", OP]
    _close(Interpreter(out)([a, b])[0], a @ b, k)


@pytest.mark.parametrize(
    "left",
    [
        lambda a: a,  # a graph input: its layout is not known when the graph is compiled
        lambda a: torch.relu(a),  # ATen's elementwise ops keep their input's layout
        lambda a: _rows(a).t().t().t().t() * 1,
    ],
)
def test_left_operand_of_unknown_layout_stays_on_mkl(left):
    """oneDNN reads a transposed left operand several times slower than MKL (HF GPT-2's weight
    gradients got saved activations transposed at run time), so only a left operand known to have
    rows of stride 1 (a kernel's, a GEMM's, a contiguous copy's, through views that keep that)
    goes to oneDNN."""
    a, b = torch.randn(512, 256), torch.randn(256, 512)
    g = capture(lambda a, b: torch.mm(left(a), b), a, b)
    assert gemm_library(g) is g


def test_views_that_keep_unit_row_stride():
    """Reshapes, unit-step slices and permutes that keep the last dim last keep a contiguous
    value's rows of stride 1; the left operand reaches oneDNN through them."""
    a, b = torch.randn(8, 64, 256), torch.randn(256, 512)

    def f(a, b):
        h = _rows(a).permute(1, 0, 2)[:, 1:7].reshape(-1, 256)
        return torch.mm(h, b)

    out = verify(gemm_library(capture(f, a, b)))
    assert OP in _ops(out) and "mm.default" not in _ops(out)
    _close(Interpreter(out)([a, b])[0], f(a, b), 256)


@pytest.mark.parametrize(
    "case",
    [
        "small",
        "short_k_narrow",
        "short_k_few_rows",
        "left_transposed",
        "float64",
        "empty_k",
        "beta",
        "bias_2d",
        "bfloat16",
    ],
)
def test_left_to_aten(case):
    """Below the size where oneDNN's call overhead pays (short reductions: too narrow or too few
    rows), a small product with a transposed left operand (a weight gradient's dY^T: below 2^25
    multiply-adds the transposing copy does not pay), other dtypes, an empty reduction (oneDNN
    cannot make a primitive), and addmm forms that are not a plain linear layer: unchanged."""
    if case == "small":
        g = capture(_mm, torch.randn(128, 128), torch.randn(128, 128))  # 2^21 multiply-adds
    elif case == "short_k_narrow":  # a short reduction, but only 256 wide: MKL is faster
        g = capture(_mm, torch.randn(1024, 10), torch.randn(10, 256))
    elif case == "short_k_few_rows":  # a short reduction, wide, but 16 rows: MKL is faster
        g = capture(_mm, torch.randn(16, 10), torch.randn(10, 1024))
    elif case == "left_transposed":  # 2^23 multiply-adds: the transposing copy would not pay
        g = capture(lambda dy, x: torch.mm(dy.t(), x), torch.randn(512, 128), torch.randn(512, 128))
    elif case == "float64":
        g = capture(_mm, torch.randn(512, 256, dtype=torch.float64), torch.randn(256, 512).double())
    elif case == "bfloat16":
        g = capture(_mm, torch.randn(512, 256).bfloat16(), torch.randn(256, 512).bfloat16())
    elif case == "empty_k":
        g = capture(_mm, torch.randn(512, 0), torch.randn(0, 512))
    elif case == "beta":
        g = capture(
            lambda x, w, b: torch.addmm(b, x, w.t(), beta=0.5),
            torch.randn(512, 256),
            torch.randn(384, 256),
            torch.randn(384),
        )
    else:
        g = capture(_linear, torch.randn(512, 256), torch.randn(384, 256), torch.randn(512, 384))
    assert gemm_library(g) is g


def _dw_after_a_peak(dy, x):
    """A weight gradient after a wide temporary (four times ``dy``, made and dropped first): the
    graph's peak memory, so a transposing copy of ``dy`` fits under it."""
    s = torch.exp(torch.cat([dy, dy, dy, dy], 1)).sum()
    return torch.mm(dy.t(), x), s


@pytest.mark.parametrize("shape", [(512, 256, 256), (1000, 250, 300)])
def test_weight_gradient_gets_a_row_major_copy(shape):
    """``mm(dy.t(), x)`` (a weight gradient, the reduction over the rows of both) above 2^25
    multiply-adds: ``dy`` is copied transposed (``t_copy``) and oneDNN reads the copy row-major."""
    rows, o, i = shape
    dy, x = torch.randn(rows, o), torch.randn(rows, i)
    out = verify(gemm_library(capture(_dw_after_a_peak, dy, x)))
    assert "mm.default" not in _ops(out)
    copy = next(n for n in out.nodes if n.op == "t_copy.default")
    assert out.nodes[copy.inputs[0]].op == "input" and copy.type.shape == (o, rows)
    lp = next(n for n in out.nodes if n.op == OP)
    assert out.nodes[lp.inputs[0]] is copy
    _close(Interpreter(out)([dy, x])[0], dy.t() @ x, rows)
    (rec,) = gemm_epilogues(out)
    assert rec["library"].startswith("oneDNN") and "copied transposed" in rec["library"]


def test_weight_gradient_copy_of_more_than_4_mib_is_not_made():
    """A masked-LM decoder's weight gradient (vocabulary x tokens x width): copies of dY over
    4 MiB measured 0.95-1.07x MKL's time for the transposed view; MKL keeps it, even with room
    under the peak."""
    dy, x = torch.randn(256, 4200), torch.randn(256, 128)  # a 4.1 MiB copy, 2^27 multiply-adds
    g = capture(_dw_after_a_peak, dy, x)
    assert "t_copy.default" not in _ops(gemm_library(g))
    dy = torch.randn(256, 4000)  # 3.9 MiB: made
    assert "t_copy.default" in _ops(gemm_library(capture(_dw_after_a_peak, dy, x)))


def test_weight_gradient_copy_never_raises_the_peak():
    """The same product alone: while it runs the graph holds ``dy``, ``x`` and the result, its
    peak, and a copy of ``dy`` would add to it, so the product stays on MKL; with symbolic sizes
    (peak unknown) too."""
    dy, x = torch.randn(512, 256), torch.randn(512, 256)
    g = capture(lambda dy, x: torch.mm(dy.t(), x), dy, x)
    assert gemm_library(g) is g


@pytest.fixture
def cpp_backend():
    saved = (config.backend, config.disk_cache, config.launcher)
    config.update(backend="cpp", disk_cache=False)
    clear_memory_cache()
    yield
    config.update(backend=saved[0], disk_cache=saved[1], launcher=saved[2])
    clear_memory_cache()


@pytest.mark.parametrize("launcher", [True, False])
def test_compiled_linear_with_strided_operands_and_bias(cpp_backend, launcher):
    """The graph is compiled for contiguous-looking inputs; at run time the operands come strided
    (the left one through a ReLU kernel, which writes it contiguous) and the bias expanded
    (stride 0: oneDNN would misread it without the `contiguous`)."""
    config.update(launcher=launcher)
    x, w, b = torch.randn(512, 256), torch.randn(384, 256), torch.randn(384)
    exe = compile_graph(
        capture(lambda x, w, b: torch.relu(torch.addmm(b, torch.relu(x), w.t())), x, w, b)
    )
    assert OP in [n.op for n in exe.graph.nodes]
    runs = [
        (x, w, b),
        (torch.randn(512, 512)[:, ::2], torch.randn(256, 384).t(), torch.randn(1).expand(384)),
        (torch.randn(256, 512).t(), torch.randn(384, 512)[:, 100:356], torch.randn(768)[::2]),
    ]
    for xi, wi, bi in runs:
        (got,) = exe([xi, wi, bi])
        _close(got, torch.relu(torch.addmm(bi, torch.relu(xi), wi.t())), 256)


@pytest.mark.parametrize("launcher", [True, False])
def test_compiled_weight_gradient_with_strided_operands(cpp_backend, launcher):
    """The weight-gradient form compiled (Kiln's transpose kernel, then oneDNN), run on the shapes
    it was compiled for and on strided operands (a sliced ``dy``, a transposed ``x``) and odd
    sizes the kernel covers with partial tiles."""
    config.update(launcher=launcher)
    dy, x = torch.randn(1000, 250), torch.randn(1000, 300)
    exe = compile_graph(capture(_dw_after_a_peak, dy, x))
    ops = [n.op for n in exe.graph.nodes]
    assert OP in ops and "t_copy.default" in ops
    runs = [
        (dy, x),
        (torch.randn(1000, 500)[:, 3:253], torch.randn(300, 1000).t()),
        (torch.randn(1000, 250), torch.randn(1000, 300)),
    ]
    for dyi, xi in runs:
        got = exe([dyi, xi])[0]
        _close(got, dyi.t() @ xi, 1000)


@pytest.mark.parametrize("shape", [(0, 256, 512), (512, 256, 0), (0, 10, 2048)])
def test_zero_size_stays_on_aten(cpp_backend, shape):
    """A product with no rows or no columns has no multiply-adds: never rewritten (oneDNN is never
    handed a zero-size GEMM), and the compiled graph gives ATen's (empty) result."""
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    exe = compile_graph(capture(lambda a, b: torch.mm(torch.relu(a), b), a, b))
    assert OP not in [n.op for n in exe.graph.nodes]
    (got,) = exe([a, b])
    assert got.shape == (m, n)
    assert torch.equal(got, torch.mm(torch.relu(a), b))


def test_disabled_by_name(cpp_backend):
    a, b = torch.randn(512, 256), torch.randn(256, 512)

    def f(a, b):
        return torch.mm(torch.relu(a), b)

    exe = compile_graph(capture(f, a, b))
    assert OP in [n.op for n in exe.graph.nodes]  # on: oneDNN
    saved = config.disable_passes
    config.update(disable_passes="gemm_library")
    try:
        clear_memory_cache()
        exe = compile_graph(capture(f, a, b))
        assert OP not in [n.op for n in exe.graph.nodes]
        assert torch.equal(exe([a, b])[0], f(a, b))  # ATen's GEMM, bit for bit
    finally:
        config.update(disable_passes=saved)
