"""Golden tests for the conditions under which constant folding and simplification leave a node
alone: random ops, results over the size limit, copies that change the memory format."""

from __future__ import annotations

import torch
from _passes_testlib import V, call, check_pass, f32

from kiln.ir import GraphBuilder, TensorType
from kiln.passes._util import static_numel
from kiln.passes.constant_fold import MAX_BYTES, constant_fold
from kiln.passes.simplify import simplify


def test_static_numel():
    assert static_numel(f32(3, 5, 7)) == 105
    assert static_numel(f32(128, 64)) == 8192
    assert static_numel(f32()) == 1
    assert static_numel(f32(0, 5)) == 0
    assert static_numel(TensorType(("s0", 4), torch.float32)) is None
    assert static_numel(TensorType((), None, py="int")) is None
    assert static_numel(None) is None


def test_random_ops_of_constants_are_not_folded():
    # not graph outputs (those never fold): only the random category keeps them
    b = GraphBuilder()
    x = b.input(f32(4))
    c = b.constant(torch.arange(4.0))
    r = call(b, "rand_like.default", [V(c)], f32(4))
    k = call(b, "bernoulli.p", [V(c), 0.5], f32(4))
    y = call(b, "add.Tensor", [V(x), V(r)], f32(4))
    z = call(b, "mul.Tensor", [V(y), V(k)], f32(4))
    g = b.build([z])
    out = constant_fold(g)
    assert str(out) == str(g)


def test_a_result_over_the_size_limit_is_not_folded_even_from_small_constants():
    # [512, 1] * [1, 256] -> 512 KiB of float32 (over the limit) from two small constants; the
    # [32, 1] * [1, 256] product (32 KiB) folds
    assert MAX_BYTES == 256 * 1024
    b = GraphBuilder()
    x = b.input(f32(512, 256))
    col, row = (
        b.constant(torch.linspace(-1, 1, 512).reshape(512, 1)),
        b.constant(torch.ones(1, 256)),
    )
    big = call(b, "mul.Tensor", [V(col), V(row)], f32(512, 256))
    y = call(b, "add.Tensor", [V(x), V(big)], f32(512, 256))
    small_col = b.constant(torch.linspace(-1, 1, 32).reshape(32, 1))
    small = call(b, "mul.Tensor", [V(small_col), V(row)], f32(32, 256))
    z = b.input(f32(32, 256))
    w = call(b, "add.Tensor", [V(z), V(small)], f32(32, 256))
    out = check_pass(
        constant_fold,
        b.build([y, w]),
        """
        graph(%0: f32[512,256], %7: f32[32,256]) {
          %1 = constant[0] : f32[512,1]
          %2 = constant[1] : f32[1,256]
          %3 = mul.Tensor(%1, %2) : f32[512,256]
          %4 = add.Tensor(%0, %3) : f32[512,256]
          %5 = constant[2] : f32[32,1]
          %6 = constant[3] : f32[32,256]
          %8 = add.Tensor(%7, %6) : f32[32,256]
          return (%4, %8)
        }""",
    )
    torch.testing.assert_close(
        out.constants[3], torch.linspace(-1, 1, 32).reshape(32, 1) * torch.ones(1, 256)
    )


def test_the_limit_is_in_bytes():
    # 65,536 booleans (64 KiB) fold; as many float32 elements (256 KiB) are at the limit and
    # fold; twice as many float32 (512 KiB) do not
    for dtype, n, folds in (
        (torch.bool, 65536, True),
        (torch.float32, 65536, True),
        (torch.float32, 131072, False),
    ):
        b = GraphBuilder()
        x = b.input(TensorType((n,), dtype))
        c = b.constant(torch.zeros(n, dtype=dtype))
        d = call(
            b,
            "logical_not.default" if dtype == torch.bool else "neg.default",
            [V(c)],
            TensorType((n,), dtype),
        )
        y = call(b, "eq.Tensor", [V(x), V(d)], TensorType((n,), torch.bool))
        out = constant_fold(b.build([y]))
        assert (len(out.constants) == 2) == folds, (dtype, n)


def test_a_reduction_of_a_constant_over_the_size_limit_is_not_folded():
    # a one-element result, but its input holds 512 KiB
    b = GraphBuilder()
    x = b.input(f32())
    c = b.constant(torch.ones(256, 512))
    s = call(b, "sum.default", [V(c)], f32())
    y = call(b, "add.Tensor", [V(x), V(s)], f32())
    g = b.build([y])
    check_pass(constant_fold, g, str(g))


def test_copies_to_another_memory_format_stay():
    # same dtype, no other change, not an output: only memory_format keeps these copies (the
    # consumer may depend on the channels-last strides they produce)
    b = GraphBuilder()
    x = b.input(f32(2, 3, 4, 5))
    cast = call(b, "_to_copy.default", [V(x)], f32(2, 3, 4, 5), memory_format=torch.channels_last)
    clone = call(b, "clone.default", [V(x)], f32(2, 3, 4, 5), memory_format=torch.channels_last)
    same = call(b, "clone.default", [V(x)], f32(2, 3, 4, 5), memory_format=torch.preserve_format)
    s = call(b, "add.Tensor", [V(cast), V(clone)], f32(2, 3, 4, 5))
    s = call(b, "add.Tensor", [V(s), V(same)], f32(2, 3, 4, 5))
    check_pass(
        simplify,
        b.build([s]),
        """
        graph(%0: f32[2,3,4,5]) {
          %1 = _to_copy.default(%0, memory_format=torch.channels_last) : f32[2,3,4,5]
          %2 = clone.default(%0, memory_format=torch.channels_last) : f32[2,3,4,5]
          %3 = add.Tensor(%1, %2) : f32[2,3,4,5]
          %4 = add.Tensor(%3, %0) : f32[2,3,4,5]
          return (%4)
        }""",
    )
