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


# --- the lazy device's form: whole nll_loss_backward + _log_softmax_backward_data ---------------
def _lazy_form(
    rows: int = 5,
    vocab: int = 7,
    reduction: int = 1,
    ignore: int = -100,
    weight: bool = False,
    other_y: bool = False,
    extra_reader: bool = False,
) -> Graph:
    """``nll_loss_backward(go, y, t, weight, reduction, ignore, tw)`` read by the log-softmax
    backward (inputs: y, the targets, go, total_weight[, weight][, another y])."""
    b = GraphBuilder()
    y = b.input(f32(rows, vocab))
    t = b.input(TensorType((rows,), I64))
    go = b.input(f32(rows) if reduction == 0 else f32())
    tw = b.input(f32())
    w = V(b.input(f32(vocab))) if weight else None
    y2 = b.input(f32(rows, vocab)) if other_y else y
    g = call(
        b,
        "nll_loss_backward.default",
        [V(go), V(y), V(t), w, reduction, ignore, V(tw)],
        f32(rows, vocab),
    )
    d = call(
        b, "_log_softmax_backward_data.default", [V(g), V(y2), 1, torch.float32], f32(rows, vocab)
    )
    return b.build([d, g] if extra_reader else [d])


def _lazy_inputs(
    rows: int, vocab: int, reduction: int, ignore: int, ignored: list[int], seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.log_softmax(torch.randn(rows, vocab, generator=gen), -1)
    t = torch.randint(0, max(vocab, 1), (rows,), generator=gen)
    t[ignored] = ignore
    go = torch.randn(rows, generator=gen) if reduction == 0 else torch.tensor(0.75)
    tw = (t != ignore).sum().to(torch.float32)
    return [y, t, go, tw]


def test_golden_rewrite_of_the_lazy_form():
    out = cross_entropy(verify(_lazy_form()))
    verify(out, deep=True)
    assert str(out) == (
        "graph(%0: f32[5,7], %1: i64[5], %2: f32[], %3: f32[]) {\n"
        "  %4 = unsqueeze.default(%1, 1) : i64[5,1]\n"
        "  %5 = ne.Scalar(%4, -100) : b8[5,1]\n"
        "  %6 = mul.Tensor(%4, %5) : i64[5,1]\n"
        "  %7 = div.Tensor(%2, %3) : f32[]\n"
        "  %8 = full.default([], 0.0, dtype=torch.float32) : f32[]\n"
        "  %9 = where.self(%5, %7, %8) : f32[5,1]\n"
        "  %10 = gather.default(%0, 1, %6) : f32[5,1]\n"
        "  %11 = nll_log_softmax_backward.default(%0, %6, %9, %10, -1.0) : f32[5,7]\n"
        "  return (%11)\n"
        "}"
    ), str(out)


@pytest.mark.parametrize(
    "rows,vocab,reduction,ignore,ignored",
    [
        (5, 7, 1, -100, []),
        (5, 7, 1, -100, [1, 3]),
        (5, 7, 1, -100, [0, 1, 2, 3, 4]),  # all ignored: total_weight 0, gradient 0
        (5, 7, 2, -100, [2]),
        (5, 7, 0, -100, [4]),
        (6, 9, 1, 3, [0, 5]),  # ignore_index inside [0, V)
        (3, 1, 1, -100, [1]),
        (1, 9, 0, -100, []),
        (0, 9, 1, -100, []),
    ],
)
def test_lazy_form_rewrite_computes_what_aten_did(rows, vocab, reduction, ignore, ignored):
    g = _lazy_form(rows, vocab, reduction, ignore)
    out = cross_entropy(g)
    verify(out, deep=True)
    ops = [n.op for n in out.nodes]
    assert ops.count("nll_log_softmax_backward.default") == 1
    assert "nll_loss_backward.default" not in ops
    xs = _lazy_inputs(rows, vocab, reduction, ignore, ignored)
    want = torch.ops.aten._log_softmax_backward_data(
        torch.ops.aten.nll_loss_backward(xs[2], xs[0], xs[1], None, reduction, ignore, xs[3]),
        xs[0],
        1,
        torch.float32,
    )
    torch.testing.assert_close(Interpreter(g)(xs)[0], want, rtol=0, atol=0)
    torch.testing.assert_close(Interpreter(out)(xs)[0], want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [7, -1])
def test_lazy_form_out_of_range_target_still_raises(bad):
    g = _lazy_form()
    out = cross_entropy(g)
    xs = _lazy_inputs(5, 7, 1, -100, [])
    xs[1][2] = bad
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        Interpreter(g)(xs)
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        Interpreter(out)(xs)


@pytest.mark.parametrize(
    "case", ["weight", "other_y", "extra_reader", "no_classes", "switched_off"]
)
def test_lazy_form_not_rewritten_outside_the_pattern(case, monkeypatch):
    if case == "no_classes":  # every row ignored, and no column 0 for a safe target
        g = _lazy_form(rows=4, vocab=0)
    elif case == "switched_off":
        import kiln

        monkeypatch.setattr(kiln.config, "disable_passes", "cross_entropy.lazy")
        g = _lazy_form()
    else:
        g = _lazy_form(**{case: True})
    assert cross_entropy(g) is g
