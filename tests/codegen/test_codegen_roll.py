"""``roll`` along the last dim fused as a rotated read (kiln/passes/fuse.py, kiln/codegen/cpp/emit.py):
RoPE forward and backward in compile mode against eager (odd sizes, size 0 and 1 dims,
non-contiguous inputs), rolled inputs never overwritten in place, and what the fuser refuses."""

from __future__ import annotations

import pytest
import torch
from kiln_codegen_testlib import check_compiled_vs_eager, cpp_only, op, run_both, t

from kiln.codegen.cpp import build
from kiln.codegen.cpp import fuse_claimed as fuse
from kiln.codegen.interpreter import Interpreter
from kiln.config import config
from kiln.ir.graph import Graph, GraphBuilder, In
from kiln.ir.kernel import FusedKernel
from kiln.passes.memory_plan import memory_plan


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return q * cos + rotate_half(q) * sin


@pytest.mark.parametrize(
    "shape",
    [(2, 3, 5, 8), (1, 1, 1, 2), (3, 1, 7, 6), (2, 0, 5, 8), (4, 2, 3, 32)],
)
def test_rope_forward_and_gradients_match_eager(shape):
    torch.manual_seed(0)
    cos, sin = torch.randn(shape[-2], shape[-1]), torch.randn(shape[-2], shape[-1])
    q = torch.randn(shape)
    check_compiled_vs_eager(rope, q, cos, sin)
    if config.backend == "cpp" and 0 not in shape:
        assert _ran_a_rolled_kernel()  # rotate_half became a rolled read in a kernel


def test_rope_on_permuted_and_sliced_inputs_matches_eager():
    torch.manual_seed(1)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)

    def from_projection(x, cos, sin):  # (B, T, H*D) -> (B, H, T, D), as attention does
        return rope(x.view(2, 5, 3, 8).transpose(1, 2), cos, sin).sum(1)

    check_compiled_vs_eager(from_projection, torch.randn(2, 5, 24), cos, sin)

    def from_slice(x, cos, sin):
        return rope(x[..., 1:9], cos, sin)

    check_compiled_vs_eager(from_slice, torch.randn(2, 3, 5, 11), cos, sin)


def test_rope_in_a_model_step_updates_parameters_as_eager():
    torch.manual_seed(2)

    class Rot(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(12, 12)
            self.register_buffer("cos", torch.randn(7, 6))
            self.register_buffer("sin", torch.randn(7, 6))

        def forward(self, x):
            q = self.q(x).view(3, 7, 2, 6).transpose(1, 2)
            return (rope(q, self.cos, self.sin) ** 2).mean()

    eager = Rot()
    comp = Rot()
    comp.load_state_dict(eager.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, comp)]

    def step(m, o, x):
        loss = m(x)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    cstep = torch.compile(step, backend="kiln")
    for _ in range(3):
        x = torch.randn(3, 7, 12)
        le, lc = step(eager, opts[0], x), cstep(comp, opts[1], x)
        torch.testing.assert_close(lc, le)
    for a, b in zip(comp.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)


def run_planned(g: Graph, inputs: list) -> tuple[list, list]:
    """(eager results, results of ``g`` fused, memory-planned and built by the C++ backend)."""
    run, _ = build(memory_plan(fuse(g)))
    return Interpreter(g)(inputs), run(inputs)


def _ran_a_rolled_kernel() -> bool:
    from kiln.runtime.compiler import executables

    return any(
        "roll.default" in k.get("members_ops", ()) or "K_" in k.get("source", "")
        for e in executables()
        for k in e.info.get("kernels", ())
    )


def _rolled_graph(shape: tuple, shift: int, other: tuple):
    """out = roll(exp(x), shift, -1) * y + exp(x)  (y of shape ``other``, broadcast)."""
    b = GraphBuilder()
    x = b.input(t(shape))
    y = b.input(t(other))
    e = op(b, "exp.default", (x,), (In(0),), t(shape))
    r = op(b, "roll.default", (e,), (In(0), [shift], [len(shape) - 1]), t(shape))
    ry = op(b, "roll.default", (y,), (In(0), [shift], [len(other) - 1]), t(other))
    m = op(b, "mul.Tensor", (r, ry), (In(0), In(1)), t(shape))
    s = op(b, "add.Tensor", (m, e), (In(0), In(1)), t(shape))
    return b.build([s])


@cpp_only
@pytest.mark.parametrize("shift", [3, -2, 0, 13])
@pytest.mark.parametrize("other", [(6, 5), (5,), (6, 1), (1,)])
def test_rolled_reads_of_every_input_mode_match_aten(shift, other):
    g = _rolled_graph((6, 5), shift, other)
    fused = fuse(g)
    kernels = [FusedKernel.of(n) for n in fused.nodes if n.op == "fused"]
    rolled = [k for k in kernels if any(e.op == "roll.default" for e in k.body)]
    # exp(x) is computed by one kernel, read rolled by another (never the kernel computing it)
    assert len(kernels) >= 2 and rolled
    for k in rolled:
        for e in k.body:
            if e.op == "roll.default":
                assert type(e.args[0]).__name__ == "In"
    x, y = torch.randn(6, 5), torch.randn(other)
    expected, got = run_planned(g, [x, y])
    torch.testing.assert_close(got[0], expected[0])


@cpp_only
def test_a_dying_input_read_rolled_is_not_overwritten_in_place():
    b = GraphBuilder()
    x = b.input(t((4, 8)))
    w = b.input(t((8, 3)))
    e = op(b, "exp.default", (x,), (In(0),), t((4, 8)))
    r = op(b, "roll.default", (e,), (In(0), [3], [1]), t((4, 8)))
    s = op(b, "add.Tensor", (r, e), (In(0), In(1)), t((4, 8)))  # e dies here
    m = op(b, "mm.default", (s, w), (In(0), In(1)), t((4, 3)))  # s is no graph output
    g = b.build([m])
    planned = memory_plan(fuse(g))
    fused = [n for n in planned.nodes if n.op == "fused"]
    assert fused[0].kwarg("placement") == (0,)
    assert fused[1].kwarg("placement") == (1,)  # a slot of its own, not e's
    x_val, w_val = torch.randn(4, 8), torch.randn(8, 3)
    expected, got = run_planned(g, [x_val, w_val])
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[0], (torch.roll(x_val.exp(), 3, 1) + x_val.exp()) @ w_val)


def test_rolls_the_fuser_leaves_to_aten():
    b = GraphBuilder()
    x = b.input(t((4, 6)))
    r0 = op(b, "roll.default", (x,), (In(0), [1], [0]), t((4, 6)))  # not the last dim
    r2 = op(b, "roll.default", (x,), (In(0), [1, 2], [0, 1]), t((4, 6)))  # two dims
    g = b.build([r0, r2])
    assert not any(n.op == "fused" for n in fuse(g).nodes)
    _, got, _ = run_both(g, [torch.arange(24.0).view(4, 6)])
    torch.testing.assert_close(got[0], torch.roll(torch.arange(24.0).view(4, 6), 1, 0))
    torch.testing.assert_close(got[1], torch.roll(torch.arange(24.0).view(4, 6), [1, 2], [0, 1]))


@cpp_only
def test_two_shifts_make_two_kernels():
    b = GraphBuilder()
    x = b.input(t((4, 6)))
    r1 = op(b, "roll.default", (x,), (In(0), [1], [1]), t((4, 6)))
    r2 = op(b, "roll.default", (x,), (In(0), [2], [1]), t((4, 6)))
    s = op(b, "add.Tensor", (r1, r2), (In(0), In(1)), t((4, 6)))
    g = b.build([s])
    fused = [FusedKernel.of(n) for n in fuse(g).nodes if n.op == "fused"]
    shifts = [{e.args[1][0] for e in k.body if e.op == "roll.default"} for k in fused]
    assert all(len(s) <= 1 for s in shifts) and len(fused) == 2
    x_val = torch.randn(4, 6)
    _, got, _ = run_both(g, [x_val])
    torch.testing.assert_close(got[0], torch.roll(x_val, 1, 1) + torch.roll(x_val, 2, 1))
