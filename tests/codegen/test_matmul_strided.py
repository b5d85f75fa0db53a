"""``kiln::matmul_strided`` (kiln/ir/matmul_strided.py; CPU kernel kiln/codegen/cpp/matmul_strided.h)
against ``torch.matmul``: values, the result's layout (``order``), gradients and their layouts,
over odd sizes, operands read through any strides (head views, transposed, stride-0 batch dims,
no unit stride at all), zero-size dims and bad arguments.  Both kernels: the native one the
launcher registers for CPU, and the reference (``torch.matmul`` copied into the layout)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.codegen.cpp import launcher
from kiln.ir import matmul_strided as ms

OP = ms.OP


def _native() -> None:
    if not launcher.available():
        pytest.skip("no native launcher on this machine")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(ms.NAME, "CPU")


KERNELS = {"native": lambda a, b, o=None: OP(a, b, o), "reference": ms._reference}


def _operand(kind: str, batch: tuple, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """A (*batch, rows, cols) tensor laid out as ``kind`` says."""
    if kind == "contiguous":
        return torch.randn(*batch, rows, cols, generator=g)
    if kind == "transposed":  # columns innermost: BLAS reads it transposed
        return torch.randn(*batch, cols, rows, generator=g).transpose(-2, -1)
    if kind == "heads":  # attention's view(B, T, H, E).transpose(1, 2) of a wider projection
        b0, *rest = batch
        x = torch.randn(b0, rows, *rest, 3 * cols, generator=g)[..., cols : 2 * cols]
        return x.movedim(1, -2)
    if kind == "broadcast":  # a stride-0 batch dim (an expanded k/v)
        x = torch.randn(batch[0], 1, *batch[2:], rows, cols, generator=g)
        return x.expand(*batch, rows, cols)
    if kind == "gather":  # no dim of stride 1: copied before the product
        return torch.randn(*batch, rows, 2 * cols, generator=g)[..., ::2]
    raise AssertionError(kind)


KINDS = ["contiguous", "transposed", "heads", "broadcast", "gather"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ka,kb", list(itertools.product(KINDS, KINDS)))
def test_values_match_torch_matmul_for_any_operand_layout(kernel, ka, kb):
    if kernel == "native":
        _native()
    g = torch.Generator().manual_seed(len(ka) * 7 + len(kb))
    for batch, (m, k, n) in [((2, 3), (5, 7, 9)), ((3, 4), (17, 1, 33)), ((1, 2), (1, 13, 1))]:
        a = _operand(ka, batch, m, k, g)
        b = _operand(kb, batch, k, n, g)
        out = KERNELS[kernel](a, b)
        ref = torch.matmul(a, b)
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("order", [None, [0, 2, 1, 3], [1, 0, 2, 3], [2, 1, 0, 3], [1, 2, 0, 3]])
def test_the_result_is_dense_in_the_order_asked_for(kernel, order):
    if kernel == "native":
        _native()
    g = torch.Generator().manual_seed(3)
    a = _operand("heads", (2, 3), 6, 5, g)
    b = _operand("transposed", (2, 3), 5, 7, g)
    out = KERNELS[kernel](a, b, order)
    want = torch.empty_permuted(out.shape, order or [0, 1, 2, 3])
    assert out.stride() == want.stride()
    torch.testing.assert_close(out, torch.matmul(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_rank_3_and_rank_5(kernel):
    if kernel == "native":
        _native()
    g = torch.Generator().manual_seed(5)
    for batch in [(4,), (2, 3, 2)]:
        a = _operand("transposed", batch, 8, 3, g)
        b = _operand("contiguous", batch, 3, 6, g)
        order = [1, 0, 2] if len(batch) == 1 else [2, 0, 1, 3, 4]
        out = KERNELS[kernel](a, b, order)
        torch.testing.assert_close(out, torch.matmul(a, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((0, 3, 4, 5), (0, 3, 5, 6)),  # no batch elements
        ((2, 3, 0, 5), (2, 3, 5, 6)),  # no rows
        ((2, 3, 4, 5), (2, 3, 5, 0)),  # no columns
        ((2, 3, 4, 0), (2, 3, 0, 6)),  # an empty sum: zeros
    ],
)
def test_zero_size(kernel, a_shape, b_shape):
    if kernel == "native":
        _native()
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    out = KERNELS[kernel](a, b, [0, 2, 1, 3])
    ref = torch.matmul(a, b)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_other_dtypes_take_the_reference_path(kernel, dtype):
    if kernel == "native":
        _native()
    a = torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5).to(dtype).transpose(1, 2)
    b = torch.arange(2 * 4 * 5 * 2).reshape(2, 4, 5, 2).to(dtype)
    out = KERNELS[kernel](a, b, [0, 2, 1, 3])
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.matmul(a, b))


NOT_AN_ORDER = (
    "matmul_strided: order {} is not a permutation of the operands' dims ending in the last"
)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_arguments_raise(kernel):
    """Each kernel raises (never aborts) with the same message for each bad argument."""
    if kernel == "native":
        _native()
    errors = (RuntimeError, ValueError)
    run = KERNELS[kernel]
    a4, b4 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 3)
    cases = [
        (
            (torch.randn(2, 3, 4), torch.randn(2, 1, 4, 3)),
            None,
            "matmul_strided takes two operands of the same rank >= 3, got 3 and 4",
        ),
        (
            (a4, torch.randn(2, 1, 5, 3)),
            None,
            "matmul_strided: batch dims differ: [2, 3, 4, 5] @ [2, 1, 5, 3]",
        ),
        (
            (a4, torch.randn(2, 3, 4, 3)),
            None,
            "matmul_strided: [2, 3, 4, 5] @ [2, 3, 4, 3]: inner dims differ",
        ),
        (
            (a4, b4.double()),
            None,
            "matmul_strided: the operands' dtypes differ; convert one to the other's",
        ),
        (
            (a4, b4),
            [0, 1, 3, 2],
            NOT_AN_ORDER.format("[0, 1, 3, 2]"),
        ),
        (
            (a4, b4),
            [0, 1, 2],
            NOT_AN_ORDER.format("[0, 1, 2]"),
        ),
    ]
    for (a, b), order, message in cases:
        with pytest.raises(errors) as e:
            run(a, b, order)
        assert str(e.value).splitlines()[0] == message


def test_shape_rule_gives_the_layout():
    a = torch.empty(2, 3, 4, 5, device="meta")
    b = torch.empty(2, 3, 5, 6, device="meta")
    out = OP(a, b, [0, 2, 1, 3])
    assert out.shape == (2, 3, 4, 6)
    assert out.stride() == torch.empty_permuted((2, 3, 4, 6), [0, 2, 1, 3]).stride()


def test_gradients_match_matmul_and_keep_each_operands_layout():
    _native()
    g = torch.Generator().manual_seed(11)
    for ka, kb in [("heads", "heads"), ("contiguous", "transposed"), ("heads", "broadcast")]:
        a0 = _operand(ka, (2, 3), 9, 5, g)
        b0 = _operand(kb, (2, 3), 5, 7, g)
        a1, b1 = a0.detach().requires_grad_(), b0.detach().requires_grad_()
        a2, b2 = a0.detach().requires_grad_(), b0.detach().requires_grad_()
        # detach keeps the operands' strides: the leaves have ka's and kb's layouts
        w = torch.randn(2, 3, 9, 7, generator=g)
        (OP(a1, b1, [0, 2, 1, 3]) * w).sum().backward()
        (torch.matmul(a2, b2) * w).sum().backward()
        torch.testing.assert_close(a1.grad, a2.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b1.grad, b2.grad, rtol=1e-5, atol=1e-5)


def test_a_gradient_is_written_in_its_operands_layout():
    g = torch.Generator().manual_seed(2)
    q = _operand("heads", (2, 3), 8, 4, g)
    k = _operand("heads", (2, 3), 8, 4, g)
    grad = torch.randn(2, 3, 8, 8, generator=g)
    # the gradient of q (a head view: dense as (B, T, H, E)) comes out in that layout, so the
    # model's reshape back to (B, T, H * E) is a view
    gq = ms.product(grad, k, q)
    assert ms.layout_of(q) == [0, 2, 1, 3] and ms.layout_of(gq) == [0, 2, 1, 3]
    torch.testing.assert_close(gq, grad @ k, rtol=1e-5, atol=1e-5)
    # the gradient of k^T (its transpose dense as (B, T, H, E)) is computed transposed
    gkt = ms.product(q.transpose(-2, -1), grad, k.transpose(-2, -1))
    assert ms.layout_of(gkt.transpose(-2, -1)) == [0, 2, 1, 3]
    torch.testing.assert_close(gkt, q.transpose(-2, -1) @ grad, rtol=1e-5, atol=1e-5)
    # an operand that is not dense (a stride-0 dim): row-major
    kb = _operand("broadcast", (2, 3), 4, 8, g)
    assert ms.layout_of(kb) is None
    assert ms.product(q, kb, kb).is_contiguous()


@pytest.mark.parametrize("launcher_on", [True, False])
def test_a_kiln_graph_runs_it_on_both_executors_and_explain_lists_it(launcher_on):
    """Lowered from ATen to a Kiln node (``order`` a constant argument), compiled by the C++
    backend and run by the native launcher or the Python executor, on head views and on other
    layouts than the ones it was captured with; ``kiln explain``'s GEMM list names it."""
    from kiln.config import config
    from kiln.frontends.compile.fx import fx_to_kiln
    from kiln.runtime.compiler import compile_graph
    from kiln.runtime.gemm_epilogues import gemm_epilogues

    if launcher_on:
        _native()
    saved = config.launcher
    config.update(launcher=launcher_on)
    try:
        g = torch.Generator().manual_seed(4)
        q, k = _operand("heads", (2, 3), 6, 4, g), _operand("heads", (2, 3), 6, 4, g)

        def f(q, k):
            s = OP(q, k.transpose(-2, -1), [0, 2, 1, 3])
            return (s.transpose(1, 2) * 2.0,)

        gm = make_fx(f)(q, k)
        graph, _ = fx_to_kiln(gm)
        (rec,) = gemm_epilogues(graph)
        assert rec["op"] == "matmul_strided.default" and "no copies" in rec["library"]
        exe = compile_graph(graph)
        assert "matmul_strided.default" in [n.op for n in exe.graph.nodes]
        for qi, ki in [
            (q, k),
            (q.contiguous(), k.contiguous()),
            (q, k.transpose(1, 2).contiguous().transpose(1, 2)),
        ]:
            (out,) = exe([qi, ki])
            torch.testing.assert_close(out, f(qi, ki)[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out, (qi @ ki.transpose(-2, -1)).transpose(1, 2) * 2.0)
    finally:
        config.update(launcher=saved)
