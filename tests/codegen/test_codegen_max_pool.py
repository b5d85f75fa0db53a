"""Generated 2-D max-pool kernels (kiln/codegen/cpp/pool.py) against ATen and eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from kiln_codegen_testlib import check_compiled_vs_eager, cpp_only, poison_outputs
from torch import nn

import kiln
from kiln.codegen.cpp import build
from kiln.codegen.interpreter import Interpreter
from kiln.ir.graph import GraphBuilder, In, Node, TensorType

F32 = torch.float32
I64 = torch.int64
FWD = "max_pool2d_with_indices.default"
BWD = "max_pool2d_with_indices_backward.default"
RELU_BWD = "max_pool2d_relu_backward.default"  # kiln.passes.pool_relu
RELU_FWD = "relu_max_pool2d.default"  # kiln.passes.relu_pool

# (input shape, kernel, stride, padding, dilation, ceil_mode)
WINDOWS = [
    ((4, 3, 8, 8), [2, 2], [], [0, 0], [1, 1], False),  # the CNN's 2x2 pooling
    ((2, 3, 9, 7), [2, 2], [2, 2], [0, 0], [1, 1], True),  # odd sizes, ceil_mode overhang
    ((2, 3, 9, 7), [3, 3], [2, 2], [1, 1], [1, 1], True),  # padding
    ((1, 2, 10, 11), [3, 2], [1, 2], [1, 0], [2, 1], False),  # dilation, overlapping rows
    ((3, 5, 5), [2, 2], [2, 2], [0, 0], [1, 1], True),  # unbatched
    ((2, 3, 6, 6), [5, 5], [3, 3], [2, 2], [1, 1], True),  # windows larger than the stride
    ((2, 1, 1, 1), [1, 1], [1, 1], [0, 0], [1, 1], False),  # 1x1
    ((2, 2, 3, 40), [2, 3], [1, 1], [1, 1], [1, 1], False),  # wide rows, every window overlaps
    ((0, 3, 8, 8), [2, 2], [], [0, 0], [1, 1], False),  # empty batch
    ((4, 17, 66, 65), [2, 2], [], [0, 0], [1, 1], True),  # large enough for the parallel loop
]


def _special(shape: tuple) -> torch.Tensor:
    """Random values with ties, NaNs and infinities in some windows."""
    x = torch.randn(shape)
    if x.numel() == 0:
        return x
    flat = x.view(-1)
    flat[::7] = 0.0  # ties (ReLU outputs: many zeros)
    flat[3::11] = float("-inf")
    flat[5::13] = float("inf")
    flat[1::17] = float("nan")
    flat[2::19] = float("nan")
    return x


def _pool_graph(shape, k, s, p, d, c, op=FWD):
    b = GraphBuilder()
    x = b.input(TensorType(shape, F32))
    y, i = torch.ops.aten.max_pool2d_with_indices(torch.empty(shape, device="meta"), k, s, p, d, c)
    types = (TensorType(tuple(y.shape), F32), TensorType(tuple(i.shape), I64))
    if op == RELU_FWD:  # (the ReLU's output first)
        types = (TensorType(shape, F32), *types)
    n = b.add(Node(op, (x,), (In(0), k, s, p, d, c), (), types))
    return b.build([b.getitem(n, k) for k in range(len(types))])


def _backward_graph(shape, k, s, p, d, c, out_shape, op=BWD):
    b = GraphBuilder()
    g = b.input(TensorType(out_shape, F32))
    x = b.input(TensorType(shape, F32))
    i = b.input(TensorType(out_shape, I64))
    n = b.add(
        Node(op, (g, x, i), (In(0), In(1), k, s, p, d, c, In(2)), (), (TensorType(shape, F32),))
    )
    return b.build([n])


@cpp_only
@pytest.mark.parametrize("op", [FWD, RELU_FWD])
@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: "x".join(map(str, c[0])) + str(c[1:]))
def test_forward_kernel_matches_aten(case, op, monkeypatch):
    poison_outputs(monkeypatch)
    g = _pool_graph(*case, op=op)
    run, info = build(g)
    assert [k["kind"] for k in info["kernels"]] == ["max_pool"]
    x = _special(case[0])
    ref = Interpreter(g)([x])
    got = run([x])
    for a, b in zip(got, ref):
        if a.dtype == I64:
            assert torch.equal(a, b)  # the same index, also among ties and NaNs
        else:  # (the ReLU's -0.0 may come out +0.0, as Kiln's relu kernels write it)
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
        assert a.is_contiguous()
    # a non-contiguous input runs the reference
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    for a, b in zip(run([xt]), ref):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


@cpp_only
@pytest.mark.parametrize("op", [BWD, RELU_BWD])
@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: "x".join(map(str, c[0])) + str(c[1:]))
def test_backward_kernel_matches_aten(case, op, monkeypatch):
    poison_outputs(monkeypatch)
    shape, k, s, p, d, c = case
    x = torch.randn(shape)
    if op == RELU_BWD:  # a ReLU's output, with NaNs and ties at zero
        x = torch.relu(_special(shape))
    y, idx = torch.ops.aten.max_pool2d_with_indices(x, k, s, p, d, c)
    g = _backward_graph(shape, k, s, p, d, c, tuple(y.shape), op)
    run, info = build(g)
    assert [k["kind"] for k in info["kernels"]] == ["max_pool"]
    dy = torch.randn(y.shape)
    ins = [dy, x, idx]
    # overlapping windows add in ATen's order: the same bits
    # (and the ReLU variant is the reference's where(x <= 0, 0, .) of the same sums)
    expected = Interpreter(g)(ins)[0]
    torch.testing.assert_close(run(ins)[0], expected, rtol=0, atol=0)
    # a non-contiguous incoming gradient is read as its values
    dyt = dy.transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(run([dyt, x, idx])[0], expected, rtol=0, atol=0)
    # a non-contiguous forward input runs the reference (ATen)
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(run([dy, xt, idx])[0], expected, rtol=0, atol=0)


@cpp_only
@pytest.mark.parametrize("op", [BWD, RELU_BWD])
def test_backward_rejects_foreign_indices(op):
    shape = (1, 2, 4, 4)
    g = _backward_graph(shape, [2, 2], [], [0, 0], [1, 1], False, (1, 2, 2, 2), op)
    run, _ = build(g)
    idx = torch.zeros(1, 2, 2, 2, dtype=I64)
    idx[0, 1, 1, 0] = 16  # outside the 4x4 plane
    with pytest.raises(RuntimeError, match="indices outside"):
        run([torch.randn(1, 2, 2, 2), torch.randn(shape), idx])
    idx[0, 1, 1, 0] = -1  # skipped, as ATen skips it
    out = run([torch.ones(1, 2, 2, 2), torch.rand(shape) + 0.5, idx])[0]
    assert out.sum().item() == 7.0


@cpp_only
@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.contiguous(memory_format=torch.channels_last),
        lambda x: x.transpose(-1, -2),
        lambda x: x.to(torch.float64),
    ],
    ids=["channels_last", "transposed", "float64"],
)
def test_other_layouts_and_dtypes_run_aten(make):
    shape, k, s, p, d, c = WINDOWS[1]
    x = make(_special(shape))
    b = GraphBuilder()
    xi = b.input(TensorType(tuple(x.shape), x.dtype))
    y, i = torch.ops.aten.max_pool2d_with_indices(x, k, s, p, d, c)
    n = b.add(
        Node(
            FWD,
            (xi,),
            (In(0), k, s, p, d, c),
            (),
            (TensorType(tuple(y.shape), x.dtype), TensorType(tuple(i.shape), I64)),
        )
    )
    run, _ = build(b.build([b.getitem(n, 0), b.getitem(n, 1)]))
    got = run([x])
    torch.testing.assert_close(got[0], y, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(got[1], i)
    assert got[0].stride() == y.stride()  # ATen's result layout (channels-last stays)


class _CNN(nn.Module):
    def __init__(self, c: int, ceil: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.ceil = ceil
        self.fc = nn.LazyLinear(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, ceil_mode=self.ceil)
        x = F.max_pool2d(F.relu(self.conv2(x)), 3, stride=2, padding=1)
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("size,ceil", [((7, 9), True), ((8, 8), False)])
def test_cnn_training_steps_match_eager(size, ceil):
    """Loss, gradients and AdamW-updated parameters over three steps, odd image sizes."""
    torch.manual_seed(0)
    model = _CNN(5, ceil)
    model(torch.randn(1, 3, *size))  # materialize the lazy layer
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]

    def step(m, opt, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, grads

    from kiln.runtime.compiler import executables

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="kiln")
    before = {id(e) for e in executables()}
    for _ in range(3):
        x, y = torch.randn(3, 3, *size), torch.randint(0, 5, (3,))
        lk, gk = compiled(model, opts[0], x, y)
        le, ge = step(ref, opts[1], x, y)
        torch.testing.assert_close(lk, le)
        for a, b in zip(gk, ge):
            torch.testing.assert_close(a, b)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b)
    if kiln.config.backend == "cpp":  # both pools and both pool backwards ran generated kernels
        kinds = [
            k["members"][0]
            for e in executables()
            if id(e) not in before
            for k in e.info.get("kernels", ())
            if k["kind"] == "max_pool"
        ]
        # the backward with the ReLU's (kiln.passes.pool_relu)
        # and the forward with the ReLU's (kiln.passes.relu_pool)
        assert sorted(kinds) == sorted([RELU_BWD, RELU_BWD, RELU_FWD, RELU_FWD]), kinds


def test_relu_pool_gradients_noncontiguous_input():
    """Values and input gradients through compile mode, input a non-contiguous view."""

    def fn(x):
        return F.max_pool2d(torch.relu(x), 2, ceil_mode=True) * 2.0

    x = torch.randn(2, 3, 11, 9).transpose(-1, -2)  # 2x3x9x11, strided
    check_compiled_vs_eager(fn, x)
