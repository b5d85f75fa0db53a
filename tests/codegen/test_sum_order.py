"""Column sums (``cols`` kernels, kiln/codegen/cpp/sum_order.py) give eager's bits: each column's
values added in the order of ATen's CPU ``sum``, on 1 and 2 threads, over shapes on every branch
of that order (straight and interleaved columns, thread splits, one column, few rows)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from kiln_codegen_testlib import cpp_only

from kiln.observe.node_times import node_times

SHAPES = [
    (1, 5),  # one row
    (3, 3),  # fewer rows than lanes
    (5, 4),  # a group of 4 columns (fewer than 8 columns)
    (33, 7),  # a group of 4, 3 interleaved columns
    (32, 10),  # 8..31 columns: all interleaved
    (100, 31),
    (100, 32),  # one block of 32: straight
    (257, 70),  # two blocks and 6 interleaved columns
    (64, 1000),  # 31 blocks and 8 columns; over 32768 elements: the threads split the columns
    (1000, 37),  # split rounds the first thread's share to 0 columns
    (1000, 69),  # the second thread's share starts at 32
    (2048, 100),
    (8192, 10),  # over 32768 elements, too few columns for a second thread
    (70000, 3),
    (7, 1),  # one column: a scalar row
    (1000, 1),  # one column: vectors of 8, 4 a step
    (100003, 1),  # one column over 32768 elements: per thread, then the threads' sums
]


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="kiln", dynamic=False)


def _run_fused(fn, *args):
    """``fn`` compiled and run once, with a check that no sum ran as an ATen call (the test would
    then compare ATen with itself)."""
    compiled = _compiled(fn)
    with node_times() as nt:
        out = compiled(*args)
    if nt.native:
        names = {name for kind, name in nt.seconds if kind == "aten"}
        assert not any(n.startswith("sum.") for n in names), names
        assert any(kind == "kernel" for kind, _ in nt.seconds)
    return out


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@cpp_only
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sum_over_rows_is_eagers_bits(threads, shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x = torch.randn(shape, generator=gen) * torch.rand(shape[1], generator=gen) * 100
    w = torch.randn(shape, generator=gen)

    def f(x, w):
        y = x * w  # a fused prologue: the summand is computed in the kernel
        return y.sum(0), (y + 1.0).sum(0, keepdim=True)

    got = _run_fused(f, x, w)
    for e, g in zip(f(x, w), got):
        assert e.shape == g.shape
        assert torch.equal(e, g), (e - g).abs().max()


@cpp_only
@pytest.mark.parametrize("shape", [(4, 64, 96), (3, 333, 40), (2, 5, 1)])
def test_sum_over_leading_dims_is_eagers_bits(threads, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)

    def f(x):
        y = torch.sigmoid(x) * x
        return y, y.sum((0, 1))  # the summand is also an output: the kernel re-reads it

    e, g = f(x), _run_fused(f, x)
    assert torch.equal(e[0], g[0])
    assert torch.equal(e[1], g[1]), (e[1] - g[1]).abs().max()


@cpp_only
def test_linear_bias_gradient_is_eagers_bits(threads):
    """A Linear layer's bias gradient, the sum of the output gradient over the batch, fused with
    SiLU's backward (a loss whose gradient is exact elementwise work: eager's log-softmax sums in
    another order than Kiln's row kernel)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40)
    x, target = torch.randn(300, 48), torch.randn(300, 40)

    def step(m, x, target):
        loss = F.mse_loss(F.silu(m(x)), target)
        loss.backward()
        return loss

    m_e, m_k = copy.deepcopy(lin), copy.deepcopy(lin)
    step(m_e, x, target)
    _compiled(step)(m_k, x, target)
    assert torch.equal(m_e.weight.grad, m_k.weight.grad)
    assert torch.equal(m_e.bias.grad, m_k.bias.grad), (m_e.bias.grad - m_k.bias.grad).abs().max()


@cpp_only
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 1)])
def test_zero_size(shape):
    x = torch.randn(shape)

    def f(x):
        return (x * 2.0).sum(0)

    e, g = f(x), _compiled(f)(x)
    assert e.shape == g.shape and torch.equal(e, g)


@cpp_only
def test_signed_zero_and_special_values():
    # more rows than kiln.passes.simplify.SMALL_SUM (fewer become adds, which keep a -0 sum)
    x = torch.tensor([[-0.0, 1.0, float("inf"), float("nan"), -0.0]] * 6)
    x[1, 2] = float("-inf")

    def f(x):
        return (x * 1.0).sum(0)

    e, g = f(x), _run_fused(f, x)
    assert torch.equal(e.isnan(), g.isnan())
    ok = ~e.isnan()
    assert torch.equal(e[ok], g[ok]) and torch.equal(e[ok].signbit(), g[ok].signbit())


@cpp_only
def test_non_contiguous_input_is_close():
    """A transposed input is read through its strides (eager's sum then takes another order):
    close to eager's, not bit for bit."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 200, generator=gen).t()

    def f(x):
        return (x * 3.0).sum(0)

    torch.testing.assert_close(_run_fused(f, x), f(x), rtol=1e-5, atol=1e-5)


ROW_SHAPES = [
    (5, 1),
    (4, 3),  # shorter than a vector: the interleaved form of 4 lanes
    (9, 7),
    (6, 8),
    (7, 33),  # one group of 32 and a vector left over... and one element past it
    (5, 100),
    (3, 1000),
    (2, 5000),  # over 16 groups of 32: the cascade carries
    (1, 40000),  # one row of 32768 elements or more: the threads' shares, then their sums
    (1, 70001),
]


@cpp_only
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sum_and_mean_over_last_dim_are_eagers_bits(threads, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) * 10

    def f(x):
        y = x * 1.5
        return y.sum(-1), (y * y).mean(-1, keepdim=True)

    e, g = f(x), _run_fused(f, x)
    for a, b in zip(e, g):
        assert a.shape == b.shape
        assert torch.equal(a, b), (a - b).abs().max()


@cpp_only
def test_rms_norm_is_eagers_bits(threads):
    """Llama's RMSNorm (transformers' formula): the mean of squares is ATen's sum / L."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(4, 16, 128, generator=gen), torch.randn(128, generator=gen)

    def f(x):
        v = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(v + 1e-6))

    e, g = f(x), _run_fused(f, x)
    # rsqrt: ATen's is 1 / sqrt (correctly rounded both), the same as the kernel's
    assert torch.equal(e, g), (e - g).abs().max()


@cpp_only
@pytest.mark.parametrize("shape", [(0, 5), (4, 0)])
def test_row_sums_of_zero_size(shape):
    x = torch.randn(shape)

    def f(x):
        y = x * 2.0
        return y.sum(-1), y.mean(-1)

    e, g = f(x), _compiled(f)(x)
    for a, b in zip(e, g):
        assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[~a.isnan()], b[~b.isnan()])


@cpp_only
def test_row_sums_of_a_non_contiguous_input_are_close():
    """A transposed input is read through its strides (eager's sum then takes another order)."""
    x = torch.randn(300, 70, generator=torch.Generator().manual_seed(4)).t()

    def f(x):
        return (x * 3.0).sum(-1), (x * 3.0).mean(-1)

    for a, b in zip(_run_fused(f, x), f(x)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
