"""Golden and numerical tests for the algebraic simplifier (kiln/passes/simplify.py)."""

from __future__ import annotations

import textwrap

import torch
from _passes_testlib import V, call, capture, check_pass, f32, same_results

from kiln.codegen.interpreter import Interpreter
from kiln.ir import GraphBuilder, TensorType, verify
from kiln.passes.dce import dce
from kiln.passes.simplify import simplify


def test_neutral_elements_disappear():
    g = capture(lambda x: (((x * 1 + -0.0 - 0) / 1) ** 1).exp(), torch.randn(4))
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[4]) {
          %1 = exp.default(%0) : f32[4]
          return (%1)
        }""",
    )


def test_a_float_plus_positive_zero_stays_an_integer_one_goes():
    # -0.0 + 0.0 is +0.0: dropping the add returned -0.0 where eager returns 0.0
    x = torch.tensor([-0.0, 0.0, 1.5, -2.0])
    g = capture(lambda x: (x + 0).exp2(), x)
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[4]) {
          %1 = add.Tensor(%0, 0) : f32[4]
          %2 = exp2.default(%1) : f32[4]
          return (%2)
        }""",
    )
    g = capture(lambda x: (x - (-0.0)).exp2(), x)  # x - (-0.0) is x + 0.0: stays
    assert any(n.op == "sub.Tensor" for n in simplify(g).nodes)
    g = capture(lambda x: (x + 0 - 0).neg(), torch.tensor([3, -1, 0]))
    assert [n.op for n in simplify(g).nodes if n.op.endswith("Tensor")] == []


def test_float_add_of_a_zero_keeps_eagers_signed_zeros_compiled():
    torch._dynamo.reset()

    def f(x):
        return torch.stack(
            [x + 0.0, 0.0 + x, x - 0.0, x + -0.0, x - -0.0, torch.add(x, 0.0, alpha=-1)]
        )

    x = torch.tensor([-0.0, 0.0, 1.0])
    got = torch.compile(f, backend="kiln")(x)
    torch._dynamo.reset()
    want = f(x)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_square_and_double_negation():
    g = capture(lambda x: (x**2).neg().neg().sin(), torch.randn(4))
    out = check_pass(
        simplify,
        g,
        """
        graph(%0: f32[4]) {
          %1 = mul.Tensor(%0, %0) : f32[4]
          %2 = neg.default(%1) : f32[4]
          %3 = sin.default(%1) : f32[4]
          return (%3)
        }""",
    )
    assert len(dce(out)) == 3  # the outer neg's input is dead now


def test_double_transpose_cancels_but_matmul_operand_stays():
    g = capture(lambda x, w: x.t().t() @ w.t(), torch.randn(4, 3), torch.randn(5, 3))
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[4,3], %1: f32[5,3]) {
          %2 = permute.default(%0, [1, 0]) : f32[3,4]
          %3 = permute.default(%1, [1, 0]) : f32[3,5]
          %4 = mm.default(%0, %3) : f32[4,5]
          return (%4)
        }""",
    )


def test_permute_chains_compose():
    g = capture(
        lambda x: (x.permute(1, 2, 0).permute(2, 0, 1).exp(), x.permute(2, 0, 1).transpose(0, 1)),
        torch.randn(2, 3, 4),
    )
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[2,3,4]) {
          %1 = permute.default(%0, [1, 2, 0]) : f32[3,4,2]
          %2 = exp.default(%0) : f32[2,3,4]
          %3 = permute.default(%0, [2, 0, 1]) : f32[4,2,3]
          %4 = permute.default(%0, [0, 2, 1]) : f32[2,4,3]
          return (%2, %4)
        }""",
    )


def test_view_chains_and_noop_views():
    g = capture(
        lambda x: x.reshape(-1).view(2, -1).exp() + x.view(4, 3).expand(4, 3).view(2, 6).exp(),
        torch.randn(4, 3),
    )
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[4,3]) {
          %1 = view.default(%0, [-1]) : f32[12]
          %2 = view.default(%0, [2, -1]) : f32[2,6]
          %3 = exp.default(%2) : f32[2,6]
          %4 = view.default(%0, [2, 6]) : f32[2,6]
          %5 = exp.default(%4) : f32[2,6]
          %6 = add.Tensor(%3, %5) : f32[2,6]
          return (%6)
        }""",
    )


def test_unsafe_rewrites_are_not_done():
    # x * 0 is NaN for x = inf/NaN; int * 1.0 is a float: neither may become x.
    def f(x):
        return (x * 0).exp(), x.int() * 1.0

    g = capture(f, torch.randn(4))
    out = check_pass(simplify, g, str(g))
    x = torch.tensor([float("inf"), float("nan"), 1.0, -2.0])
    from kiln.codegen.interpreter import Interpreter

    torch.testing.assert_close(Interpreter(out)([x])[0], f(x)[0], equal_nan=True)


def test_neutral_cast_and_clone():
    b = GraphBuilder()
    x = b.input(f32(4, 3))
    same = call(b, "_to_copy.default", [V(x)], f32(4, 3), dtype=torch.float32)
    e1 = call(b, "exp.default", [V(same)], f32(4, 3))
    wider = call(
        b, "_to_copy.default", [V(x)], TensorType((4, 3), torch.float64), dtype=torch.float64
    )
    c = call(b, "clone.default", [V(e1)], f32(4, 3))
    s = call(b, "add.Tensor", [V(c), V(wider)], TensorType((4, 3), torch.float64))
    out_copy = call(b, "clone.default", [V(x)], f32(4, 3))  # a graph output: must stay a copy
    g = b.build([s, out_copy])
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[4,3]) {
          %1 = exp.default(%0) : f32[4,3]
          %2 = _to_copy.default(%0, dtype=torch.float64) : f64[4,3]
          %3 = add.Tensor(%1, %2) : f64[4,3]
          %4 = clone.default(%0) : f32[4,3]
          return (%3, %4)
        }""",
    )


def test_copy_read_through_strides_stays():
    # expand(x) is not dense; clone makes it dense, and the view needs that.
    b = GraphBuilder()
    x = b.input(f32(1, 3))
    e = call(b, "expand.default", [V(x), (4, 3)], f32(4, 3))
    c = call(b, "clone.default", [V(e)], f32(4, 3))
    v = call(b, "view.default", [V(c), (12,)], f32(12))
    g = b.build([v])
    check_pass(simplify, g, str(g))


def test_copy_of_a_fresh_result_goes_even_when_a_view_reads_it():
    # softmax's result is fresh and dense: its clone has its very strides, so the view may read
    # it directly (the hand-written attention's clone before the second bmm).  A clone of an
    # input (any strides) read by a view stays.
    b = GraphBuilder()
    x = b.input(f32(2, 4, 4))
    sm = call(b, "_softmax.default", [V(x), -1, False], f32(2, 4, 4))
    c = call(b, "clone.default", [V(sm)], f32(2, 4, 4))
    v = call(b, "view.default", [V(c), (8, 4)], f32(8, 4))
    ci = call(b, "clone.default", [V(x)], f32(2, 4, 4))
    vi = call(b, "view.default", [V(ci), (8, 4)], f32(8, 4))
    s = call(b, "add.Tensor", [V(v), V(vi)], f32(8, 4))
    g = b.build([s])
    check_pass(
        simplify,
        g,
        """
        graph(%0: f32[2,4,4]) {
          %1 = _softmax.default(%0, -1, False) : f32[2,4,4]
          %2 = view.default(%1, [8, 4]) : f32[8,4]
          %3 = clone.default(%0) : f32[2,4,4]
          %4 = view.default(%3, [8, 4]) : f32[8,4]
          %5 = add.Tensor(%2, %4) : f32[8,4]
          return (%5)
        }""",
    )


def test_copy_stays_when_an_opaque_op_mutates():
    b = GraphBuilder()
    x = b.input(f32(4))
    c = call(b, "clone.default", [V(x)], f32(4))
    m = call(b, "opaque.aten::mul_.Tensor", [V(x), 2.0], f32(4))
    s = call(b, "add.Tensor", [V(c), V(m)], f32(4))
    g = b.build([s])
    check_pass(simplify, g, str(g))


def test_symbolic_shapes_are_opaque_values():
    b = GraphBuilder()
    x = b.input(TensorType(("s0", 4), torch.float32))
    v = call(b, "view.default", [V(x), ("s0", 4)], TensorType(("s0", 4), torch.float32))
    p = call(b, "permute.default", [V(v), (1, 0)], TensorType((4, "s0"), torch.float32))
    q = call(b, "permute.default", [V(p), (1, 0)], TensorType(("s0", 4), torch.float32))
    e = call(b, "exp.default", [V(q)], TensorType(("s0", 4), torch.float32))
    g = b.build([e])
    out = verify(simplify(g))
    assert str(out) == (
        "graph(%0: f32[s0,4]) {\n"
        "  %1 = permute.default(%0, [1, 0]) : f32[4,s0]\n"
        "  %2 = exp.default(%0) : f32[s0,4]\n"
        "  return (%2)\n"
        "}"
    )


def test_outputs_never_become_inputs():
    # x * 1 as the only output: replacing it by the input would hand the caller its own tensor.
    g = capture(lambda x: x * 1, torch.randn(3))
    check_pass(simplify, g, str(g))


def test_random_and_opaque_ops_pass_through():
    b = GraphBuilder()
    x = b.input(f32(8))
    d = call(b, "native_dropout.default", [V(x), 0.5, True], [f32(8), TensorType((8,), torch.bool)])
    y = b.getitem(d, 0)
    nz = call(b, "opaque.aten::nonzero.default", [V(x)], TensorType(("u0", 1), torch.int64))
    g = b.build([y, nz])
    out = verify(simplify(g))
    assert str(out) == str(g)


def test_simplify_is_idempotent_on_a_captured_mlp():
    def mlp(x, w1, b1, w2, b2):
        F = torch.nn.functional
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    ws = torch.randn(16, 8), torch.randn(16), torch.randn(4, 16), torch.randn(4)
    g = capture(mlp, torch.randn(3, 8), *ws)
    once = verify(simplify(g))
    same_results(g, once)
    assert str(simplify(once)) == str(once)


def test_view_sized_by_graph_values_is_kept_unless_types_are_symbolic():
    # view(x, [%n, 4]) with types recorded at the trace-time size: equal now, not provably always.
    b = GraphBuilder()
    x = b.input(f32(3, 4))
    n = call(b, "sym_size.int", [V(x), 0], TensorType((), None, "int"))
    v = call(b, "view.default", [V(x), (V(n), 4)], f32(3, 4))
    e = call(b, "exp.default", [V(v)], f32(3, 4))
    g = b.build([e])
    check_pass(simplify, g, str(g))
    b = GraphBuilder()
    sym = TensorType(("s0", 4), torch.float32)
    x = b.input(sym)
    n = call(b, "sym_size.int", [V(x), 0], TensorType((), None, "int"))
    v = call(b, "view.default", [V(x), (V(n), 4)], sym)
    g = b.build([call(b, "exp.default", [V(v)], sym)])
    assert "view" not in str(verify(simplify(g)))


def test_constant_operand_with_different_elements_is_not_a_neutral_number():
    """``x * [1, 2, 3]`` is not ``x``: only a constant whose elements are all the neutral value may
    be dropped (``x * [1, 1, 1] -> x``); ``x + [0, 0, 1]`` keeps its add too."""
    b = GraphBuilder()
    x = b.input(f32(2, 3))
    scale = b.constant(torch.tensor([1.0, 2.0, 3.0]))
    ones = b.constant(torch.tensor([1.0, 1.0, 1.0]))
    shift = b.constant(torch.tensor([0.0, 0.0, 1.0]))
    m = call(b, "mul.Tensor", [V(x), V(scale)], f32(2, 3))
    k = call(b, "mul.Tensor", [V(m), V(ones)], f32(2, 3))
    a = call(b, "add.Tensor", [V(k), V(shift)], f32(2, 3))
    r = call(b, "mul.Tensor", [V(scale), V(a)], f32(2, 3))  # constant first: commuted form
    g = b.build([r])
    out = dce(simplify(g))
    verify(out)
    ops = [n.op for n in out.nodes]
    assert ops.count("mul.Tensor") == 2 and ops.count("add.Tensor") == 1, str(out)
    same_results(g, out)


def test_small_sum_over_a_middle_dim_becomes_adds_of_selects():
    """Grouped-query attention's gradient of the repeated heads: ``sum(view(dv, (B, KV, G, T, D)),
    [2], keepdim)`` then ``squeeze``: adds of strided selects, one view, the squeeze folded."""
    g = capture(
        lambda dv: dv.view(3, 2, 2, 5, 7).sum(2, keepdim=True).squeeze(2).exp(),
        torch.randn(3, 4, 5, 7),
    )
    check_pass(
        lambda x: dce(simplify(x)),
        g,
        """
        graph(%0: f32[3,4,5,7]) {
          %1 = view.default(%0, [3, 2, 2, 5, 7]) : f32[3,2,2,5,7]
          %2 = select.int(%1, 2, 0) : f32[3,2,5,7]
          %3 = select.int(%1, 2, 1) : f32[3,2,5,7]
          %4 = add.Tensor(%2, %3) : f32[3,2,5,7]
          %5 = exp.default(%4) : f32[3,2,5,7]
          return (%5)
        }""",
    )


def test_small_sum_sizes_dims_and_dtypes():
    x = torch.randn(4, 3, 5)
    # three and four elements, a negative dim, no keepdim; odd sizes; zero-size other dims
    for fn, ex in (
        (lambda a: a.sum(1), x),
        (lambda a: a.sum(-3, keepdim=True), x),
        (lambda a: a.sum(0).exp(), torch.randn(2, 0, 3)),
        (lambda a: a.transpose(0, 1).sum(0), torch.randn(5, 2, 3)),  # non-contiguous
    ):
        g = capture(fn, ex)
        out = dce(simplify(g))
        assert out.count(lambda n: n.op == "sum.dim_IntList") == 0
        assert out.count(lambda n: n.op == "select.int") >= 2
        verify(out)
        same_results(g, out)
    # left as ATen's reduction: the last dim, more than four elements, several dims, ints
    for fn, ex in (
        (lambda a: a.sum(-1), torch.randn(4, 3)),
        (lambda a: a.sum(0), torch.randn(5, 3)),
        (lambda a: a.sum((0, 1)), torch.randn(2, 2, 3)),
        (lambda a: a.sum(0), torch.randint(0, 5, (2, 3), dtype=torch.int32)),
        (lambda a: a.sum(0, dtype=torch.float64), torch.randn(2, 3)),
    ):
        g = capture(fn, ex)
        out = dce(simplify(g))
        assert out.count(lambda n: n.op == "sum.dim_IntList") == 1, str(g)
        same_results(g, out)


def test_a_rule_can_be_switched_off_by_name():
    from kiln.config import config as kiln_config

    g = capture(lambda a: a.sum(1), torch.randn(4, 2, 3))
    before = kiln_config.disable_passes
    try:
        kiln_config.update(disable_passes="simplify.small_sum")
        assert dce(simplify(g)).count(lambda n: n.op == "sum.dim_IntList") == 1
    finally:
        kiln_config.update(disable_passes=before)
    assert dce(simplify(g)).count(lambda n: n.op == "sum.dim_IntList") == 0


def _fill_then(
    op: str, x_type: TensorType, fill_first: bool, value: float = 1, fill_dtype=torch.float32
) -> object:
    """``op(fill(empty_like(x), value), x)`` (or the operands the other way round)."""
    b = GraphBuilder()
    fill_type = TensorType((3, 5), fill_dtype)
    s = b.input(fill_type)
    x = b.input(x_type)
    e = call(b, "empty_like.default", [V(s)], fill_type, memory_format=torch.preserve_format)
    f = call(b, "fill.Scalar", [V(e), value], fill_type)
    out = TensorType((3, 5), torch.promote_types(fill_dtype, x_type.dtype))
    d = call(b, op, [V(f), V(x)] if fill_first else [V(x), V(f)], out)
    return b.build([d])


def test_fill_operand_becomes_a_one_element_full():
    """SiLU backward's ``1 - sigmoid`` through ATen's ``empty_like(b).fill_(1).sub_(b)``."""
    out = check_pass(
        simplify,
        _fill_then("sub.Tensor", f32(3, 5), fill_first=True),
        """
        graph(%0: f32[3,5], %1: f32[3,5]) {
          %2 = empty_like.default(%0, memory_format=torch.preserve_format) : f32[3,5]
          %3 = fill.Scalar(%2, 1) : f32[3,5]
          %4 = full.default([], 1, dtype=torch.float32) : f32[]
          %5 = sub.Tensor(%4, %1) : f32[3,5]
          return (%5)
        }""",
    )
    assert [n.op for n in dce(out).nodes if n.op != "input"] == ["full.default", "sub.Tensor"]
    for op in ("add.Tensor", "mul.Tensor", "div.Tensor"):
        for first in (True, False):
            g = _fill_then(op, f32(3, 5), first, value=0.1)
            out = simplify(g)
            assert "full.default" in {n.op for n in out.nodes}, (op, first)
            same_results(g, out)
    # bfloat16: the 0-dim full holds 0.1 rounded to bfloat16, as the fill did
    bf = TensorType((3, 5), torch.bfloat16)
    g = _fill_then("sub.Tensor", bf, True, value=0.1, fill_dtype=torch.bfloat16)
    out = simplify(g)
    assert "full.default" in {n.op for n in out.nodes}
    same_results(g, out)


def test_fill_operand_stays_where_the_fill_sets_the_shape_or_dtype():
    # the other operand broadcasts: the fill's shape is the result's
    g = _fill_then("sub.Tensor", f32(5), fill_first=True)
    assert "full.default" not in {n.op for n in simplify(g).nodes}
    # the other operand is float64 (a 0-dim float32 fill would not promote the same way against
    # a float16 operand: the rule asks for equal dtypes)
    g = _fill_then("mul.Tensor", TensorType((3, 5), torch.float64), fill_first=False)
    assert "full.default" not in {n.op for n in simplify(g).nodes}
    same_results(g, simplify(g))
    # a float16 operand with a float32 fill: the result is float32 because the fill has dims
    g = _fill_then("sub.Tensor", TensorType((3, 5), torch.float16), fill_first=True)
    assert "full.default" not in {n.op for n in simplify(g).nodes}
    # an integer fill read by a float op: the types differ, left as it is
    g = _fill_then("add.Tensor", f32(3, 5), True, value=2, fill_dtype=torch.int64)
    assert "full.default" not in {n.op for n in simplify(g).nodes}
    same_results(g, simplify(g))


def test_dynamo_fma_forms_of_addcdiv_and_addcmul_are_undone():
    """Dynamo writes ``p.addcdiv_(t1, t2, value=v)`` as ``fma(t1 / t2, v, p)`` (and addcmul_ with
    a product): back to ATen's ops, or to the kernel's own order for a 0-dim tensor ``v``."""
    b = GraphBuilder()
    x, t1, t2 = b.input(f32(8)), b.input(f32(8)), b.input(f32(8))
    v = b.input(f32())
    q = call(b, "div.Tensor", [V(t1), V(t2)], f32(8))
    p = call(b, "mul.Tensor", [V(t1), V(t2)], f32(8))
    outs = [
        call(b, "fma.default", [V(q), 0.3, V(x)], f32(8)),
        call(b, "fma.default", [V(p), -0.01, V(x)], f32(8)),
        call(b, "fma.default", [V(q), V(v), V(x)], f32(8)),
        call(b, "fma.default", [V(p), V(v), V(x)], f32(8)),
    ]
    check_pass(
        lambda g: dce(simplify(g)),
        b.build(outs),
        """
        graph(%0: f32[8], %1: f32[8], %2: f32[8], %3: f32[]) {
          %4 = addcdiv.default(%0, %1, %2, value=0.3) : f32[8]
          %5 = addcmul.default(%0, %1, %2, value=-0.01) : f32[8]
          %6 = mul.Tensor(%1, %3) : f32[8]
          %7 = div.Tensor(%6, %2) : f32[8]
          %8 = add.Tensor(%0, %7) : f32[8]
          %9 = mul.Tensor(%1, %3) : f32[8]
          %10 = fma.default(%9, %2, %0) : f32[8]
          return (%4, %5, %8, %10)
        }""",
    )


def test_dynamo_fma_form_in_bf16_gives_eagers_addcdiv():
    """In bf16 the number form becomes ``addcdiv`` (one rounding: eager's bits, where the fma of
    a rounded quotient is not); a 0-dim tensor ``v`` stays, as op-by-op rounding would not be
    the kernel's either."""
    bf = TensorType((64,), torch.bfloat16)
    b = GraphBuilder()
    x, t1, t2 = b.input(bf), b.input(bf), b.input(bf)
    v = b.input(TensorType((), torch.bfloat16))
    q = call(b, "div.Tensor", [V(t1), V(t2)], bf)
    outs = [
        call(b, "fma.default", [V(q), 0.3, V(x)], bf),
        call(b, "fma.default", [V(q), V(v), V(x)], bf),
    ]
    out = dce(simplify(b.build(outs)))
    assert (
        str(out)
        == textwrap.dedent(
            """
        graph(%0: bf16[64], %1: bf16[64], %2: bf16[64], %3: bf16[]) {
          %4 = div.Tensor(%1, %2) : bf16[64]
          %5 = addcdiv.default(%0, %1, %2, value=0.3) : bf16[64]
          %6 = fma.default(%4, %3, %0) : bf16[64]
          return (%5, %6)
        }"""
        ).strip()
    ), str(out)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(3)]
    got = Interpreter(out)([*xs, torch.tensor(0.5, dtype=torch.bfloat16)])[0]
    want = torch.addcdiv(xs[0], xs[1], xs[2], value=0.3)
    assert torch.equal(got, want)


def test_unbind_becomes_selects_and_a_stack_of_unsqueezes_becomes_stack():
    """The optimizer forms' per-parameter numbers: ``stack`` of 0-dim step counters (decomposed to
    unsqueezes and a ``cat``) and ``unbind`` of the result (decomposed to slice + squeeze pairs)."""
    g = capture(
        lambda a, b, c: [u * 2 for u in torch.stack([a, b, c]).exp().unbind(0)],
        torch.randn(()),
        torch.randn(()),
        torch.randn(()),
    )
    assert g.count(lambda n: n.op == "slice.Tensor") == 3, str(g)
    assert g.count(lambda n: n.op == "cat.default") == 1, str(g)
    check_pass(
        lambda x: dce(simplify(x)),
        g,
        """
        graph(%0: f32[], %1: f32[], %2: f32[]) {
          %3 = stack.default([%0, %1, %2], 0) : f32[3]
          %4 = exp.default(%3) : f32[3]
          %5 = select.int(%4, 0, 0) : f32[]
          %6 = select.int(%4, 0, 1) : f32[]
          %7 = select.int(%4, 0, 2) : f32[]
          %8 = mul.Tensor(%5, 2) : f32[]
          %9 = mul.Tensor(%6, 2) : f32[]
          %10 = mul.Tensor(%7, 2) : f32[]
          return (%8, %9, %10)
        }""",
    )


def test_selects_and_stacks_over_other_dims_sizes_and_layouts():
    x = torch.randn(4, 3, 5)
    for fn, ex, n_select in (
        (lambda a: [u.exp() for u in a.unbind(1)], (x,), 3),  # a middle dim
        (lambda a: [u.exp() for u in a.unbind(-1)], (x,), 5),  # a negative dim
        (lambda a: a[:, -1:].squeeze(1).exp(), (x,), 1),  # a negative start
        (lambda a: [u.exp() for u in a.transpose(0, 2).unbind(0)], (x,), 5),  # strided
        (lambda a: [u.exp() for u in a.unbind(0)], (torch.randn(2, 0),), 2),  # zero-size rows
    ):
        g = capture(fn, *ex)
        out = dce(simplify(g))
        assert out.count(lambda n: n.op == "select.int") == n_select, str(out)
        assert out.count(lambda n: n.op == "slice.Tensor") == 0, str(out)
        verify(out)
        same_results(g, out)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    for fn, d in (
        # torch decomposes stack along these dims to a viewed cat; the unsqueeze form by hand:
        (lambda p, q: torch.cat([p.unsqueeze(1), q.unsqueeze(1)], 1).exp(), 1),
        (lambda p, q: torch.cat([p.unsqueeze(-1), q.unsqueeze(2)], -1).exp(), 2),
    ):
        g = capture(fn, a, b)
        out = dce(simplify(g))
        stacks = [n for n in out.nodes if n.op == "stack.default"]
        assert len(stacks) == 1 and stacks[0].args[1] == d, str(out)
        verify(out)
        same_results(g, out)


def test_slices_and_cats_that_are_not_selects_or_stacks_stay():
    x = torch.randn(4, 3)
    for fn, ex in (
        (lambda a: a[1:3].exp(), (x,)),  # two rows, nothing squeezed
        (lambda a: a[::2][:1].squeeze(0).exp(), (x,)),  # a step of 2 before the unit slice
        (
            lambda a: a[:, 1:2].squeeze(1).exp(),
            (torch.randn(4, 3),),
        ),  # is a select: positive control
    ):
        g = capture(fn, *ex)
        out = dce(simplify(g))
        verify(out)
        same_results(g, out)
    g = capture(lambda a: a[:, 1:2].squeeze(1).exp(), x)
    assert dce(simplify(g)).count(lambda n: n.op == "select.int") == 1
    # a cat whose parts are unsqueezed along another dim than the cat's, or mixed with a plain
    # tensor, is no stack
    for fn, ex in (
        (lambda p, q: torch.cat([p.unsqueeze(0), q.unsqueeze(0)], 1).exp(), (x, x)),
        (lambda p, q: torch.cat([p.unsqueeze(0), q], 0).exp(), (x, torch.randn(2, 4, 3))),
    ):
        g = capture(fn, *ex)
        out = dce(simplify(g))
        assert out.count(lambda n: n.op == "stack.default") == 0, str(out)
        same_results(g, out)
