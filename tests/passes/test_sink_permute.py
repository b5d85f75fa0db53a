"""Golden and numerical tests for the permute-sinking pass (kiln/passes/sink_permute.py)."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, check_pass, f32, same_results

from kiln.ir import GraphBuilder
from kiln.ir.graph import TensorType
from kiln.passes.sink_permute import sink_permutes

P = [0, 2, 1, 3]


def _attention_glue(reader: str = "view") -> tuple[GraphBuilder, int]:
    """``view(permute(out + s * flag), (B*T, C))``: the shape of nanoGPT's fully-masked-row term
    after SDPA (odd sizes: B=3, H=2, T=5, D=7)."""
    b = GraphBuilder()
    out = b.input(f32(3, 2, 5, 7))
    s = b.input(f32(3, 2, 1, 7))
    flag = b.input(f32(5, 1))
    m = call(b, "mul.Tensor", [V(s), V(flag)], f32(3, 2, 5, 7))
    a = call(b, "add.Tensor", [V(out), V(m)], f32(3, 2, 5, 7))
    p = call(b, "permute.default", [V(a), P], f32(3, 5, 2, 7))
    if reader == "view":
        r = call(b, "reshape.default", [V(p), [15, 14]], f32(15, 14))
    else:
        q = call(b, "permute.default", [V(out), P], f32(3, 5, 2, 7))
        r = call(b, "cat.default", [[V(q), V(p)], 2], f32(3, 5, 4, 7))
    return b, r


def test_permute_sinks_through_an_elementwise_chain_read_by_a_reshape():
    b, r = _attention_glue("view")
    g = b.build([r])
    check_pass(
        sink_permutes,
        g,
        """
        graph(%0: f32[3,2,5,7], %1: f32[3,2,1,7], %2: f32[5,1]) {
          %3 = permute.default(%0, [0, 2, 1, 3]) : f32[3,5,2,7]
          %4 = permute.default(%1, [0, 2, 1, 3]) : f32[3,1,2,7]
          %5 = view.default(%2, [1, 1, 5, 1]) : f32[1,1,5,1]
          %6 = permute.default(%5, [0, 2, 1, 3]) : f32[1,5,1,1]
          %7 = mul.Tensor(%4, %6) : f32[3,5,2,7]
          %8 = add.Tensor(%3, %7) : f32[3,5,2,7]
          %9 = reshape.default(%8, [15, 14]) : f32[15,14]
          return (%9)
        }""",
    )


def test_permute_sinks_when_read_by_cat():
    b, r = _attention_glue("cat")
    g = b.build([r])
    out = check_pass(
        sink_permutes,
        g,
        """
        graph(%0: f32[3,2,5,7], %1: f32[3,2,1,7], %2: f32[5,1]) {
          %3 = permute.default(%0, [0, 2, 1, 3]) : f32[3,5,2,7]
          %4 = permute.default(%1, [0, 2, 1, 3]) : f32[3,1,2,7]
          %5 = view.default(%2, [1, 1, 5, 1]) : f32[1,1,5,1]
          %6 = permute.default(%5, [0, 2, 1, 3]) : f32[1,5,1,1]
          %7 = mul.Tensor(%4, %6) : f32[3,5,2,7]
          %8 = add.Tensor(%3, %7) : f32[3,5,2,7]
          %9 = permute.default(%0, [0, 2, 1, 3]) : f32[3,5,2,7]
          %10 = cat.default([%9, %8], 2) : f32[3,5,4,7]
          return (%10)
        }""",
    )
    assert out.count(lambda n: n.op == "add.Tensor") == 1


def test_permute_read_by_a_matmul_stays():
    # mm reads a permuted operand by stride: nothing to gain, the graph is left as it is
    b = GraphBuilder()
    x = b.input(f32(4, 6))
    w = b.input(f32(4, 5))
    e = call(b, "exp.default", [V(x)], f32(4, 6))
    p = call(b, "permute.default", [V(e), [1, 0]], f32(6, 4))
    m = call(b, "mm.default", [V(p), V(w)], f32(6, 5))
    g = b.build([m])
    check_pass(sink_permutes, g, str(g))


def test_elementwise_value_with_other_readers_or_returned_stays():
    b = GraphBuilder()
    x = b.input(f32(2, 3, 4))
    e = call(b, "exp.default", [V(x)], f32(2, 3, 4))
    p = call(b, "permute.default", [V(e), [1, 0, 2]], f32(3, 2, 4))
    r = call(b, "reshape.default", [V(p), [24]], f32(24))
    g = b.build([r, e])  # exp is also an output: moving it would change what the caller gets
    check_pass(sink_permutes, g, str(g))
    b2 = GraphBuilder()
    x = b2.input(f32(2, 3, 4))
    e = call(b2, "exp.default", [V(x)], f32(2, 3, 4))
    p = call(b2, "permute.default", [V(e), [1, 0, 2]], f32(3, 2, 4))
    g2 = b2.build([p])  # the permute itself returned: the caller's strides are kept
    check_pass(sink_permutes, g2, str(g2))


def test_layout_ops_and_symbolic_sizes_stay():
    b = GraphBuilder()
    x = b.input(f32(2, 3, 4))
    c = call(b, "clone.default", [V(x)], f32(2, 3, 4))
    p = call(b, "permute.default", [V(c), [1, 0, 2]], f32(3, 2, 4))
    r = call(b, "reshape.default", [V(p), [24]], f32(24))
    g = b.build([r])
    check_pass(sink_permutes, g, str(g))
    b2 = GraphBuilder()
    x = b2.input(TensorType(("s0", 3, 4), torch.float32))
    e = call(b2, "exp.default", [V(x)], TensorType(("s0", 3, 4), torch.float32))
    p = call(b2, "permute.default", [V(e), [1, 0, 2]], TensorType((3, "s0", 4), torch.float32))
    r = call(b2, "reshape.default", [V(p), [-1]], TensorType(("3*s0*4",), torch.float32))
    g2 = b2.build([r])
    assert str(sink_permutes(g2)) == str(g2)


def test_size_one_and_size_zero_dims():
    for shape in ((1, 2, 1, 3), (2, 0, 3, 1)):
        b = GraphBuilder()
        x = b.input(f32(*shape))
        y = b.input(f32(shape[-1]))
        a = call(b, "sub.Tensor", [V(x), V(y)], f32(*shape))
        pshape = tuple(shape[d] for d in P)
        p = call(b, "permute.default", [V(a), P], f32(*pshape))
        n = 1
        for s in pshape:
            n *= s
        r = call(b, "reshape.default", [V(p), [n]], f32(n))
        g = b.build([r])
        out = sink_permutes(g)
        assert out.count(lambda n: n.op == "sub.Tensor") == 1
        assert g.nodes[g.outputs[0]].types == out.nodes[out.outputs[0]].types
        same_results(g, out)


def _rope_grad_glue(shape: tuple[int, int, int, int], shift: int, readers: int = 1):
    """``reshape(permute(roll(g, shift, 3) * sin + g * cos, P))``: RoPE's gradient after ``rotate``
    (a one-dim roll), permuted back to ``(B, T, H, D)`` and flattened for the projection's GEMM."""
    b = GraphBuilder()
    g = b.input(f32(*shape))
    sin = b.input(f32(*shape))
    cos = b.input(f32(shape[-1]))
    r = call(b, "roll.default", [V(g), [shift], [3]], f32(*shape))
    m1 = call(b, "mul.Tensor", [V(r), V(sin)], f32(*shape))
    m2 = call(b, "mul.Tensor", [V(g), V(cos)], f32(*shape))
    a = call(b, "add.Tensor", [V(m1), V(m2)], f32(*shape))
    pshape = tuple(shape[d] for d in P)
    p = call(b, "permute.default", [V(a), P], f32(*pshape))
    n = 1
    for s in pshape:
        n *= s
    outs = [call(b, "reshape.default", [V(p), [n]], f32(n))]
    if readers > 1:  # the roll read by something else too: it stays where it is
        outs.append(call(b, "exp.default", [V(r)], f32(*shape)))
    return b.build(outs)


def test_permute_sinks_through_a_roll_along_its_permuted_dim():
    g = _rope_grad_glue((2, 3, 5, 6), 3)
    out = sink_permutes(g)
    rolls = [n for n in out.nodes if n.op == "roll.default"]
    assert len(rolls) == 1
    roll = rolls[0]
    assert list(roll.args[1]) == [3] and list(roll.args[2]) == [3]  # dim 3 stays last under P
    assert out.nodes[roll.inputs[0]].op == "permute.default"  # rolls the permuted gradient
    assert out.count(lambda n: n.op == "permute.default" and n.inputs[0] == out.outputs[0]) == 0
    # the add and both products now compute in the permuted order (no permute of the sum)
    adds = [i for i, n in enumerate(out.nodes) if n.op == "add.Tensor"]
    assert len(adds) == 1 and out.nodes[adds[0]].type.shape == (2, 5, 3, 6)
    same_results(g, out)


def test_roll_along_a_moved_dim_and_odd_sizes():
    # roll along dim 1 (H), which the permute moves to dim 2; odd sizes, a negative shift
    b = GraphBuilder()
    x = b.input(f32(3, 5, 7, 1))
    r = call(b, "roll.default", [V(x), [-2], [1]], f32(3, 5, 7, 1))
    e = call(b, "exp.default", [V(r)], f32(3, 5, 7, 1))
    p = call(b, "permute.default", [V(e), P], f32(3, 7, 5, 1))
    flat = call(b, "reshape.default", [V(p), [105]], f32(105))
    g = b.build([flat])
    out = sink_permutes(g)
    rolls = [n for n in out.nodes if n.op == "roll.default"]
    assert len(rolls) == 1 and list(rolls[0].args[2]) == [2]
    same_results(g, out)


def test_roll_with_other_readers_or_zero_size_stays_correct():
    g = _rope_grad_glue((2, 3, 5, 6), 3, readers=2)
    out = sink_permutes(g)
    # the roll has a second reader: it is not moved below the permute (and not duplicated)
    assert out.count(lambda n: n.op == "roll.default") == 1
    same_results(g, out)
    g0 = _rope_grad_glue((2, 0, 5, 6), 1)
    same_results(g0, sink_permutes(g0))


def test_roll_of_an_expanded_table_rolls_the_table():
    """RoPE's gradient multiplies by ``roll(expand(sin))``: the permute sunk through it rolls the
    ``(1, T, 1, D)`` table and expands the result, instead of a rolled copy at the full shape."""
    shape = (2, 3, 5, 6)
    b = GraphBuilder()
    g_in = b.input(f32(*shape))
    sin = b.input(f32(1, 1, 5, 6))
    e = call(b, "expand.default", [V(sin), list(shape)], f32(*shape))
    r = call(b, "roll.default", [V(e), [3], [3]], f32(*shape))
    m = call(b, "mul.Tensor", [V(g_in), V(r)], f32(*shape))
    p = call(b, "permute.default", [V(m), P], f32(2, 5, 3, 6))
    flat = call(b, "reshape.default", [V(p), [180]], f32(180))
    g = b.build([flat])
    out = sink_permutes(g)
    rolls = [n for n in out.nodes if n.op == "roll.default"]
    assert len(rolls) == 1 and rolls[0].type.shape == (1, 5, 1, 6)
    assert list(rolls[0].args[2]) == [3]
    same_results(g, out)
    # broadcast along the rolled dim: the roll is not moved onto the table
    b = GraphBuilder()
    g_in = b.input(f32(*shape))
    col = b.input(f32(1, 1, 5, 1))
    e = call(b, "expand.default", [V(col), list(shape)], f32(*shape))
    r = call(b, "roll.default", [V(e), [3], [3]], f32(*shape))
    m = call(b, "mul.Tensor", [V(g_in), V(r)], f32(*shape))
    p = call(b, "permute.default", [V(m), P], f32(2, 5, 3, 6))
    flat = call(b, "reshape.default", [V(p), [180]], f32(180))
    g2 = b.build([flat])
    out2 = sink_permutes(g2)
    assert [n.type.shape for n in out2.nodes if n.op == "roll.default"] == [(2, 5, 3, 6)]
    same_results(g2, out2)
