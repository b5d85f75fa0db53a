"""Golden and numerical tests for the rotation pass (kiln/passes/rotate.py): RoPE's rotate_half
and its gradient become ``roll`` (times a -1/1 constant), exactly eager's values."""

from __future__ import annotations

import pytest
import torch
from _passes_testlib import V, call, capture, check_pass, f32, same_results

from kiln.codegen.interpreter import Interpreter
from kiln.ir import GraphBuilder, TensorType
from kiln.passes.rotate import rotate


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return q * cos + rotate_half(q) * sin


def test_rotate_half_becomes_a_signed_roll():
    g = capture(rope, torch.randn(2, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    out = check_pass(
        rotate,
        g,
        """
        graph(%0: f32[2,3,5,8], %1: f32[5,8], %2: f32[5,8]) {
          %3 = mul.Tensor(%0, %1) : f32[2,3,5,8]
          %4 = roll.default(%0, [4], [3]) : f32[2,3,5,8]
          %5 = constant[0] : f32[8]
          %6 = mul.Tensor(%4, %5) : f32[2,3,5,8]
          %7 = mul.Tensor(%6, %2) : f32[2,3,5,8]
          %8 = add.Tensor(%3, %7) : f32[2,3,5,8]
          return (%8)
        }""",
    )
    assert out.constants[0].tolist() == [-1.0] * 4 + [1.0] * 4


def test_swapped_halves_without_neg_are_a_plain_roll():
    # odd size: the halves are 2 and 3 long; a roll by L - s = 3
    g = capture(lambda x: torch.cat((x[:, 2:], x[:, :2]), 1), torch.randn(4, 5))
    check_pass(
        rotate,
        g,
        """
        graph(%0: f32[4,5]) {
          %1 = roll.default(%0, [3], [1]) : f32[4,5]
          return (%1)
        }""",
    )


def _scatter_pair(order: tuple[int, int], lo: tuple, hi: tuple, fill: str = "full.default"):
    """add(slice_scatter(zeros, a, 1, *lo), slice_scatter(zeros, b, 1, *hi)) in ``order``;
    ``zeros`` a ``full`` of 0, or a ``new_zeros`` (the lazy recorders' slice_backward)."""
    b = GraphBuilder()
    a = b.input(f32(3, 2))
    c = b.input(f32(3, 4))
    if fill == "new_zeros.default":
        z = call(b, fill, [V(a), [3, 6]], f32(3, 6))
    else:
        z = call(b, fill, [[3, 6], 0], f32(3, 6), dtype=torch.float32)
    s1 = call(b, "slice_scatter.default", [V(z), V(a), 1, *lo], f32(3, 6))
    s2 = call(b, "slice_scatter.default", [V(z), V(c), 1, *hi], f32(3, 6))
    first, second = (s1, s2) if order == (0, 1) else (s2, s1)
    out = call(b, "add.Tensor", [V(first), V(second)], f32(3, 6))
    return b.build([out])


@pytest.mark.parametrize(
    "fill,hi",
    [
        ("full.default", (2, 9223372036854775807)),
        # the native lazy recorder records slice_backward as new_zeros + slice_scatter (table.py)
        ("new_zeros.default", (2, 6)),
    ],
)
def test_slice_scatters_of_zeros_that_tile_a_dim_become_a_cat(fill, hi):
    golden = """
        graph(%0: f32[3,2], %1: f32[3,4]) {
          %2 = cat.default([%0, %1], 1) : f32[3,6]
          return (%2)
        }"""
    for order in ((0, 1), (1, 0)):
        g = _scatter_pair(order, (0, 2), hi, fill=fill)
        check_pass(rotate, g, golden)  # also: the same values on the interpreter


def test_slice_scatters_into_new_zeros_of_another_type_stay():
    # a fill whose type is not the result's (here float64 into a float32 add) is not taken
    b = GraphBuilder()
    a = b.input(f32(3, 2))
    c = b.input(f32(3, 4))
    f64 = TensorType((3, 6), torch.float64)
    z = call(b, "new_zeros.default", [V(a), [3, 6]], f64, dtype=torch.float64)
    s1 = call(b, "slice_scatter.default", [V(z), V(a), 1, 0, 2], f64)
    s2 = call(b, "slice_scatter.default", [V(z), V(c), 1, 2, 6], f64)
    g = b.build([call(b, "add.Tensor", [V(s1), V(s2)], f32(3, 6))])
    assert rotate(g) is g


def test_slice_scatters_that_leave_a_gap_or_overlap_stay():
    for lo, hi in (((0, 2), (3, 7)), ((0, 3), (2, 6)), ((1, 3), (3, 7))):
        b = GraphBuilder()
        a = b.input(f32(3, lo[1] - lo[0]))
        c = b.input(f32(3, min(hi[1], 6) - hi[0]))
        z = call(b, "full.default", [[3, 6], 0], f32(3, 6), dtype=torch.float32)
        s1 = call(b, "slice_scatter.default", [V(z), V(a), 1, *lo], f32(3, 6))
        s2 = call(b, "slice_scatter.default", [V(z), V(c), 1, *hi], f32(3, 6))
        out = call(b, "add.Tensor", [V(s1), V(s2)], f32(3, 6))
        g = b.build([out])
        assert rotate(g) is g


def test_scatters_into_a_nonzero_fill_stay():
    b = GraphBuilder()
    a = b.input(f32(3, 2))
    c = b.input(f32(3, 4))
    z = call(b, "full.default", [[3, 6], 1.0], f32(3, 6), dtype=torch.float32)
    s1 = call(b, "slice_scatter.default", [V(z), V(a), 1, 0, 2], f32(3, 6))
    s2 = call(b, "slice_scatter.default", [V(z), V(c), 1, 2, 6], f32(3, 6))
    g = b.build([call(b, "add.Tensor", [V(s1), V(s2)], f32(3, 6))])
    assert rotate(g) is g


def test_cat_of_slices_of_different_tensors_or_unswapped_stays():
    for fn in (
        lambda x, y: torch.cat((x[:, 2:], y[:, :2]), 1),  # two tensors
        lambda x, y: torch.cat((x[:, :2], x[:, 2:]), 1),  # not swapped: x itself
        lambda x, y: torch.cat((x[:, 3:], x[:, :2]), 1),  # a gap
        lambda x, y: torch.cat((x[2:], x[:2]), 1),  # sliced along another dim than the cat
    ):
        g = capture(fn, torch.randn(4, 4), torch.randn(4, 4))
        assert "roll" not in str(rotate(g))


def test_rope_gradient_is_one_rolled_product():
    # the backward of rope: dq = dy * cos + rotate_half^T(dy * sin)
    def grad_of_rope(q, cos, sin, dy):
        return torch.autograd.grad(rope(q, cos, sin), q, dy)[0]

    def traced(q, cos, sin, dy):
        q = q.detach().requires_grad_()
        with torch.enable_grad():
            return grad_of_rope(q, cos, sin, dy)

    xs = (torch.randn(2, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8), torch.randn(2, 3, 5, 8))
    g = capture(traced, *xs)
    out = rotate(g)
    ops = [n.op for n in out.nodes]
    assert "slice_scatter.default" not in ops and "cat.default" not in ops, out
    rolls = [n for n in out.nodes if n.op == "roll.default"]
    # dy and sin rolled (sin through an expand to dy's shape), no roll of a computed product
    assert len(rolls) == 2 and all(out.nodes[n.inputs[0]].op != "mul.Tensor" for n in rolls)
    same_results(g, out)
    torch.testing.assert_close(traced(*xs), grad_of_rope(xs[0].requires_grad_(), *xs[1:]))


def test_rope_values_and_gradients_are_bit_exact_on_the_interpreter():
    for q in (torch.randn(2, 3, 5, 8), torch.randn(2, 5, 3, 8).transpose(1, 2)):
        cos, sin = torch.randn(5, 8), torch.randn(5, 8)
        g = capture(rope, q, cos, sin)
        got = Interpreter(rotate(g))([q, cos, sin])[0]
        assert torch.equal(got, rope(q, cos, sin))


def _grad_of_rope(q, cos, sin, dy):
    q = q.detach().requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(rope(q, cos, sin), q, dy)[0]


def test_rope_gradient_through_slice_backward_is_one_rolled_product():
    # undecomposed (what the lazy device records): the slices' gradients are opaque
    # slice_backward nodes (zeros with the gradient written into a range), added
    for shape in ((2, 3, 5, 8), (1, 1, 1, 2), (2, 3, 5, 6)):
        xs = (torch.randn(shape), torch.randn(shape[-2:]), torch.randn(shape[-2:]))
        xs = (*xs, torch.randn(shape))
        g = capture(_grad_of_rope, *xs, decompose=False)
        assert any(n.op == "opaque.aten::slice_backward.default" for n in g.nodes), g
        out = rotate(g)
        ops = [n.op for n in out.nodes]
        assert not any(op.startswith("opaque.") for op in ops), out
        assert "cat.default" not in ops and "roll.default" in ops, out
        same_results(g, out)
        got = Interpreter(out)(list(xs))[0]
        torch.testing.assert_close(got, _grad_of_rope(*xs), rtol=0, atol=0)


def test_slice_backward_pairs_that_do_not_tile_the_dim_stay():
    b = GraphBuilder()
    a = b.input(f32(3, 2))
    c = b.input(f32(3, 3))
    sb = "opaque.aten::slice_backward.default"
    s1 = call(b, sb, [V(a), [3, 6], 1, 0, 2, 1], f32(3, 6))
    s2 = call(b, sb, [V(c), [3, 6], 1, 3, 6, 1], f32(3, 6))  # a gap at column 2
    g = b.build([call(b, "add.Tensor", [V(s1), V(s2)], f32(3, 6))])
    assert rotate(g) is g


def _rotate_half_of_two_view_chains(dims2: tuple[int, int]):
    """cat(-t(x)[..., 4:], t'(x)[..., :4]) where t and t' are separate transpose nodes of x (the
    lazy device replays a view chain at every read): t' = transpose(x, *dims2)."""
    b = GraphBuilder()
    x = b.input(f32(2, 5, 3, 8))
    t1 = call(b, "transpose.int", [V(x), 1, 2], f32(2, 3, 5, 8))
    t2 = call(b, "transpose.int", [V(x), *dims2], f32(2, 3, 5, 8))
    hi = call(b, "slice.Tensor", [V(t1), 3, 4, 9223372036854775807], f32(2, 3, 5, 4))
    lo = call(b, "slice.Tensor", [V(t2), 3, 0, 4], f32(2, 3, 5, 4))
    n = call(b, "neg.default", [V(hi)], f32(2, 3, 5, 4))
    return b.build([call(b, "cat.default", [[V(n), V(lo)], -1], f32(2, 3, 5, 8))])


def test_rotate_half_of_two_equal_view_chains_becomes_a_roll():
    g = _rotate_half_of_two_view_chains((1, 2))
    out = rotate(g)
    ops = [n.op for n in out.nodes]
    assert "roll.default" in ops and "cat.default" not in ops, out
    same_results(g, out)


def test_rotate_half_of_view_chains_with_other_arguments_stays():
    # transpose(x, 2, 1) equals transpose(x, 1, 2) in value, but only nodes equal argument for
    # argument are taken as one tensor: left as it is (never a roll of two different tensors)
    g = _rotate_half_of_two_view_chains((2, 1))
    assert "roll" not in str(rotate(g))


def test_rotate_half_of_views_of_two_inputs_stays():
    b = GraphBuilder()
    x = b.input(f32(2, 5, 3, 8))
    y = b.input(f32(2, 5, 3, 8))
    t1 = call(b, "transpose.int", [V(x), 1, 2], f32(2, 3, 5, 8))
    t2 = call(b, "transpose.int", [V(y), 1, 2], f32(2, 3, 5, 8))
    hi = call(b, "slice.Tensor", [V(t1), 3, 4, 9223372036854775807], f32(2, 3, 5, 4))
    lo = call(b, "slice.Tensor", [V(t2), 3, 0, 4], f32(2, 3, 5, 4))
    g = b.build([call(b, "cat.default", [[V(hi), V(lo)], -1], f32(2, 3, 5, 8))])
    assert "roll" not in str(rotate(g))
