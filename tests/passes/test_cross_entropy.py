"""Golden and numerical tests for the cross-entropy backward pass (kiln/passes/cross_entropy.py)."""

from __future__ import annotations

import pytest
import torch
from _passes_testlib import V, call, f32

from kiln.codegen.interpreter import Interpreter
from kiln.ir import GraphBuilder, verify
from kiln.ir.graph import Graph, TensorType
from kiln.passes.cross_entropy import cross_entropy

I64 = torch.int64


def _loss_backward(
    rows: int = 5,
    vocab: int = 7,
    scale_shape: tuple = (5, 1),
    value: float = -1.0,
    fill: str = "full_like",
    scale_first: bool = False,
    extra_reader: bool = False,
) -> Graph:
    """The decomposed ``nll_loss_backward`` + ``_log_softmax_backward_data`` of a backward graph
    (inputs: the saved log-softmax, the safe targets, the per-row scale)."""
    b = GraphBuilder()
    y = b.input(f32(rows, vocab))
    t = b.input(TensorType((rows, 1), I64))
    w = b.input(f32(*scale_shape))
    if fill == "full_like":
        z = call(b, "full_like.default", [V(y), 0], f32(rows, vocab), pin_memory=False)
    else:
        z = call(b, "zeros.default", [[rows, vocab]], f32(rows, vocab))
    s = call(b, "scatter.value", [V(z), 1, V(t), value], f32(rows, vocab))
    args = [V(w), V(s)] if scale_first else [V(s), V(w)]
    m = call(b, "mul.Tensor", args, f32(rows, vocab))
    d = call(
        b, "_log_softmax_backward_data.default", [V(m), V(y), 1, torch.float32], f32(rows, vocab)
    )
    return b.build([d, s] if extra_reader else [d])


def _inputs(rows: int, vocab: int, scale_shape: tuple, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.log_softmax(torch.randn(rows, vocab, generator=gen), -1)
    t = torch.randint(0, vocab, (rows, 1), generator=gen)
    w = torch.randn(scale_shape, generator=gen)
    return [y, t, w]


def test_golden_rewrite():
    g = _loss_backward()
    out = cross_entropy(verify(g))
    verify(out, deep=True)
    assert str(out) == (
        "graph(%0: f32[5,7], %1: i64[5,1], %2: f32[5,1]) {\n"
        "  %3 = gather.default(%0, 1, %1) : f32[5,1]\n"
        "  %4 = nll_log_softmax_backward.default(%0, %1, %2, %3, -1.0) : f32[5,7]\n"
        "  return (%4)\n"
        "}"
    ), str(out)


@pytest.mark.parametrize(
    "rows,vocab,scale_shape,fill,scale_first,value",
    [
        (5, 7, (5, 1), "full_like", False, -1.0),
        (5, 7, (), "zeros", True, -1.0),
        (3, 1, (1,), "full_like", False, -1.0),
        (1, 9, (1, 1), "full_like", True, 2.5),
        (0, 9, (0, 1), "full_like", False, -1.0),
    ],
)
def test_rewrite_computes_what_the_decomposition_did(
    rows, vocab, scale_shape, fill, scale_first, value
):
    g = _loss_backward(rows, vocab, scale_shape, value, fill, scale_first)
    out = cross_entropy(g)
    assert [n.op for n in out.nodes].count("nll_log_softmax_backward.default") == 1
    assert not any(n.op.startswith(("scatter", "full", "zeros", "mul")) for n in out.nodes)
    xs = _inputs(rows, vocab, scale_shape)
    want = Interpreter(g)(xs)[0]
    got = Interpreter(out)(xs)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [7, -1, 2**40])
def test_out_of_range_target_still_raises(bad):
    g = _loss_backward()
    out = cross_entropy(g)
    y, t, w = _inputs(5, 7, (5, 1))
    t[2, 0] = bad
    with pytest.raises(RuntimeError, match="out of bounds") as before:
        Interpreter(g)([y, t, w])
    with pytest.raises(RuntimeError, match="out of bounds") as after:
        Interpreter(out)([y, t, w])
    assert type(after.value) is type(before.value)


@pytest.mark.parametrize(
    "case",
    ["scatter_read_elsewhere", "scale_per_column", "scale_full", "nonzero_fill"],
)
def test_no_rewrite_outside_the_pattern(case):
    if case == "scatter_read_elsewhere":
        g = _loss_backward(extra_reader=True)
    elif case in ("scale_per_column", "scale_full"):
        shape = (7,) if case == "scale_per_column" else (5, 7)
        g = _loss_backward(scale_shape=shape)
    else:
        b = GraphBuilder()
        y = b.input(f32(5, 7))
        t = b.input(TensorType((5, 1), I64))
        w = b.input(f32(5, 1))
        z = call(b, "full_like.default", [V(y), 1.0], f32(5, 7))
        s = call(b, "scatter.value", [V(z), 1, V(t), -1.0], f32(5, 7))
        m = call(b, "mul.Tensor", [V(s), V(w)], f32(5, 7))
        d = call(b, "_log_softmax_backward_data.default", [V(m), V(y), 1, torch.float32], f32(5, 7))
        g = b.build([d])
    assert cross_entropy(g) is g
