"""The cross-entropy backward kernel (kiln/codegen/cpp/cross_entropy.py, built from
kiln/passes/cross_entropy.py) against the decomposition it replaces and against eager PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kiln_codegen_testlib import check_compiled_vs_eager, cpp_only, op, poison_outputs, t

from kiln.codegen.cpp import build, fuse_claimed
from kiln.codegen.interpreter import Interpreter
from kiln.ir.graph import GraphBuilder, In
from kiln.passes.cross_entropy import cross_entropy
from kiln.runtime.compiler import executables

F32 = torch.float32
KIND = "nll_log_softmax_backward"


def _graph(rows: int, vocab: int, scale_shape: tuple, value: float = -1.0):
    b = GraphBuilder()
    y = b.input(t((rows, vocab)))
    tg = b.input(t((rows, 1), torch.int64))
    w = b.input(t(scale_shape))
    z = op(b, "full_like.default", [y], (In(0), 0), t((rows, vocab)))
    s = op(b, "scatter.value", [z, tg], (In(0), 1, In(1), value), t((rows, vocab)))
    m = op(b, "mul.Tensor", [s, w], (In(0), In(1)), t((rows, vocab)))
    d = op(
        b, "_log_softmax_backward_data.default", [m, y], (In(0), In(1), 1, F32), t((rows, vocab))
    )
    return b.build([d])


@cpp_only
@pytest.mark.parametrize(
    "rows,vocab,scale_shape,value",
    [
        (5, 7, (5, 1), -1.0),
        (13, 1001, (13, 1), -1.0),  # V not a multiple of any vector width
        (4, 1, (4, 1), -1.0),  # one class: [R, 1] inputs read as "full"
        (3, 33, (), -1.0),
        (3, 33, (1, 1), 0.5),
        (1, 17, (1,), -1.0),
        (0, 9, (0, 1), -1.0),  # zero rows
    ],
)
def test_kernel_matches_the_decomposition(monkeypatch, rows, vocab, scale_shape, value):
    poison_outputs(monkeypatch)
    g = _graph(rows, vocab, scale_shape, value)
    rewritten = cross_entropy(g)
    assert rewritten is not g
    run, info = build(fuse_claimed(rewritten))
    assert KIND in [k["kind"] for k in info["kernels"]]
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    y = torch.log_softmax(torch.randn(rows, vocab, generator=gen) * 4, -1)
    tg = torch.randint(0, vocab, (rows, 1), generator=gen)
    w = torch.randn(scale_shape, generator=gen)
    if rows > 2 and scale_shape == (rows, 1):
        w[1] = 0.0  # an ignored row: zero scale
    want = Interpreter(g)([y, tg, w])[0]
    got = run([y, tg, w])[0]
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


@cpp_only
def test_strided_targets_and_scale(monkeypatch):
    """Targets and scale read through their strides (columns of wider tensors)."""
    poison_outputs(monkeypatch)
    g = _graph(6, 11, (6, 1))
    run, _ = build(fuse_claimed(cross_entropy(g)))
    y = torch.log_softmax(torch.randn(6, 11), -1)
    tg = torch.randint(0, 11, (6, 3))[:, 1:2]
    w = torch.randn(6, 2)[:, 1:]
    assert not tg.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(run([y, tg, w])[0], Interpreter(g)([y, tg, w])[0])


@cpp_only
def test_out_of_range_target_raises_and_writes_nothing_outside():
    g = _graph(4, 9, (4, 1))
    run, _ = build(fuse_claimed(cross_entropy(g)))
    y = torch.log_softmax(torch.randn(4, 9), -1)
    for bad in (9, -1, 2**40):
        tg = torch.tensor([[1], [bad], [0], [8]])
        with pytest.raises(RuntimeError, match="out of bounds"):
            run([y, tg, torch.ones(4, 1)])


def _kinds_run(fn) -> list[str]:
    runs = {id(e): e.runs for e in executables()}
    fn()
    ran = [e for e in executables() if e.runs > runs.get(id(e), 0)]
    return [k["kind"] for e in ran for k in e.info.get("kernels", [])]


def _targets(rows: int, vocab: int, ignore: int = -100, frac: float = 0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows + vocab)
    tg = torch.randint(0, vocab, (rows,), generator=gen)
    tg[torch.rand(rows, generator=gen) < frac] = ignore
    return tg


CASES = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "ignore_index_3": {"ignore_index": 3},
    "class_weights": {"weight": "w"},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rows,vocab", [(13, 37), (6, 1001), (1, 5)])
def test_cross_entropy_matches_eager(case, rows, vocab):
    kw = dict(CASES[case])
    ignore = kw.get("ignore_index", -100)
    tg = _targets(rows, vocab, ignore)
    if kw.get("weight") == "w":
        kw["weight"] = torch.rand(vocab) + 0.5
    x = torch.randn(rows, vocab) * 3

    def loss(x):
        return F.cross_entropy(x, tg, **kw)

    kinds = _kinds_run(lambda: check_compiled_vs_eager(loss, x))
    from kiln.config import config

    # class weights make the scale per column (where(row kept, g * weight, 0): [R, V]): left to
    # the decomposition's kernels, which still match eager
    if config.backend == "cpp" and case != "class_weights":
        assert KIND in kinds


def test_all_rows_ignored_and_zero_rows():
    for rows in (4, 0):
        tg = torch.full((rows,), -100)

        def loss(x, tg=tg):
            return F.cross_entropy(x, tg)

        x = torch.randn(rows, 9)
        torch._dynamo.reset()
        xe = x.clone().requires_grad_()
        le = loss(xe)
        le.backward()
        xk = x.clone().requires_grad_()
        lk = torch.compile(loss, backend="kiln")(xk)
        lk.backward()
        torch.testing.assert_close(lk, le, equal_nan=True)
        torch.testing.assert_close(xk.grad, xe.grad, equal_nan=True)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "causal_shift"])
def test_non_contiguous_logits(layout):
    tg = _targets(12, 31)

    def loss(x):
        if layout == "transposed":  # x: [V, R]
            logits = x.t()
        elif layout == "sliced":  # x: [R, 2V]
            logits = x[:, ::2]
        else:  # x: [3, 5, V]: transformers' shift, then view
            logits = x[:, :-1, :].reshape(-1, x.shape[-1])
        return F.cross_entropy(logits, tg)

    shape = {"transposed": (31, 12), "sliced": (12, 62), "causal_shift": (3, 5, 31)}[layout]
    check_compiled_vs_eager(loss, torch.randn(shape))


def test_label_smoothing_and_bf16_match_eager():
    tg = _targets(10, 23)
    check_compiled_vs_eager(
        lambda x: F.cross_entropy(x, tg, label_smoothing=0.1), torch.randn(10, 23)
    )
    check_compiled_vs_eager(
        lambda x: F.cross_entropy(x, tg), torch.randn(10, 23, dtype=torch.bfloat16)
    )


def test_transformers_causal_lm_loss():
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 101, (3, 9), generator=gen)
    labels[0, :4] = -100

    def loss(logits):
        return loss_utils.ForCausalLMLoss(logits, labels, vocab_size=101)

    kinds = _kinds_run(lambda: check_compiled_vs_eager(loss, torch.randn(3, 9, 101, generator=gen)))
    from kiln.config import config

    if config.backend == "cpp":
        assert KIND in kinds


def test_compiled_out_of_range_target_raises_like_eager():
    tg = torch.tensor([0, 3, 9, 1])

    def loss(x):
        return F.cross_entropy(x, tg)

    x = torch.randn(4, 9, requires_grad=True)
    with pytest.raises((IndexError, RuntimeError)) as eager:
        loss(x).backward()
    torch._dynamo.reset()
    with pytest.raises((IndexError, RuntimeError)) as compiled:
        torch.compile(loss, backend="kiln")(x).backward()
    assert "out of bounds" in str(compiled.value) and "out of bounds" in str(eager.value)
