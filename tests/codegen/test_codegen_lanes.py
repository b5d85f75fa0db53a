"""Lane kernels (kiln/codegen/cpp/lanes.py): a horizontally fused kernel of identical chains emits
the chain once, looped over the lanes, and computes what the flat kernel computed."""

from __future__ import annotations

import copy

import pytest
import torch
from kiln_codegen_testlib import cpp_only, op, run_both, t
from optim_cases import OPTIMIZERS, mse_step

import kiln
from kiln.codegen.cpp import build, lanes
from kiln.codegen.cpp import fuse_claimed as fuse
from kiln.codegen.interpreter import Interpreter
from kiln.ir.graph import GraphBuilder, In
from kiln.ir.kernel import Val
from kiln.passes.memory_plan import memory_plan

F = "f32"
MODES = {k: ("torch.float32", "full") for k in range(6)}


def _chain(k: int, base: int) -> list[tuple]:
    """exp(x_k * 2) + 1, as body entries starting at ``base``."""
    return [
        ("mul.Tensor", (In(k), 2.0), (), F),
        ("exp.default", (Val(base),), (), F),
        ("add.Tensor", (Val(base + 1), 1.0), (), F),
    ]


def test_identical_chains_are_one_class_of_lanes():
    body = tuple(_chain(0, 0) + _chain(1, 3) + _chain(2, 6))
    classes = lanes.find_lanes(body, (2, 5, 8), {k: MODES[k] for k in range(3)})
    assert classes is not None and len(classes) == 1
    assert [lane[1] for lane in classes[0]] == [[0], [1], [2]]  # each lane's own input
    assert [lane[2] for lane in classes[0]] == [[0], [1], [2]]  # and output


def test_a_cut_chain_is_a_class_of_its_own():
    body = tuple(_chain(0, 0) + _chain(1, 3) + _chain(2, 6)[:2])
    classes = lanes.find_lanes(body, (2, 5, 7), {k: MODES[k] for k in range(3)})
    assert classes is not None and sorted(len(c) for c in classes) == [1, 2]


def test_shared_input_or_aliased_buffers_join_lanes():
    modes = {k: MODES[k] for k in range(2)}
    shared = tuple(_chain(0, 0) + _chain(0, 3))  # both chains read input 0: one component
    assert lanes.find_lanes(shared, (2, 5), {0: MODES[0]}) is None
    body = tuple(_chain(0, 0) + _chain(1, 3))
    assert lanes.find_lanes(body, (2, 5), modes) is not None
    # output 0 written over input 1 (another lane's): lane by lane would read it after the write
    assert lanes.find_lanes(body, (2, 5), modes, alias=((1, 0),)) is None
    assert lanes.find_lanes(body, (2, 5), modes, alias=((0, 0),)) is not None


def test_different_chains_are_not_lanes():
    other = [("mul.Tensor", (In(1), 3.0), (), F), ("exp.default", (Val(3),), (), F)]
    other.append(("add.Tensor", (Val(4), 1.0), (), F))
    body = tuple(_chain(0, 0) + other)
    assert lanes.find_lanes(body, (2, 5), {k: MODES[k] for k in range(2)}) is None


def _lanes_graph(shape: tuple, k: int = 3):
    """k independent chains (one input each, plus a one-element input each): horizontally fused."""
    b = GraphBuilder()
    outs = []
    for j in range(k):
        x = b.input(t(shape))
        s = b.input(t(()))
        y = op(b, "mul.Tensor", [x, s], (In(0), In(1)), t(shape))
        z = op(b, "sigmoid.default", [y], (In(0),), t(shape))
        outs.append(op(b, "add.Tensor", [z, x], (In(0), In(1)), t(shape)))
    return b.build(outs)


def _inputs(shape: tuple, k: int = 3) -> list:
    return [v for _ in range(k) for v in (torch.randn(shape), torch.randn(()))]


def _lane_sources(info: dict) -> list[str]:
    return [k["source"] for k in info["kernels"] if "T0_[" in k["source"]]


@cpp_only
# (12000,): each lane below PARALLEL_MIN, the three together above it (the parallel path)
@pytest.mark.parametrize("shape", [(7, 13), (0, 5), (1,), (12000,), (40000,)], ids=str)
def test_lane_kernel_matches_interpreter_and_flat_kernel(shape, monkeypatch):
    g = _lanes_graph(shape)
    xs = _inputs(shape)
    expected, got, info = run_both(g, xs)
    assert len(_lane_sources(info)) == 1 and len(info["kernels"]) == 1
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e)
    monkeypatch.setattr(lanes, "ENABLED", False)
    flat_run, flat_info = build(fuse(g))
    assert not _lane_sources(flat_info)
    for a, f in zip(got, flat_run(xs)):
        assert torch.equal(a, f)  # same formulas, same element order: the same bits


@cpp_only
def test_lane_kernel_is_emitted_without_the_flat_source(monkeypatch):
    """A lane kernel's flat source is never made; its source is the lane form of the spec the flat
    emitter would have filled in (as when lanes were made from the flat kernel's spec)."""
    from kiln.codegen import cpp
    from kiln.codegen.cpp.emit import emit_flat, kernel_spec

    g = fuse(_lanes_graph((7, 13)))
    node = next(n for n in g.nodes if n.op == "fused")
    in_types = [g.nodes[j].types[0] for j in node.inputs]
    old_spec = kernel_spec("KILN_KERNEL", node, in_types)
    emit_flat(old_spec, node, in_types)  # flat first (fills the spec in), then lanes, as before
    old_src = lanes.lane_kernel(old_spec, node, in_types, cpp._input_slots(g, node))
    flat_calls = []

    def counting_flat(*args):
        flat_calls.append(args)
        return cpp.emit.emit_flat(*args)

    monkeypatch.setattr(cpp, "emit_flat", counting_flat)
    _, info = build(g)
    assert not flat_calls
    (kernel,) = info["kernels"]
    assert old_src is not None and kernel["source"] == old_src.replace(
        "KILN_KERNEL", kernel["name"]
    )
    build(fuse(_lanes_graph((7, 13), k=1)))  # one chain: no lanes, the flat kernel
    assert len(flat_calls) == 1


@cpp_only
def test_graphs_of_other_sizes_share_the_lane_kernel():
    _, _, a = run_both(_lanes_graph((5, 3)), _inputs((5, 3)))
    _, _, b = run_both(_lanes_graph((9, 11)), _inputs((9, 11)))
    assert _lane_sources(a) and _lane_sources(a) == _lane_sources(b)
    assert a["kernels"][0]["name"] == b["kernels"][0]["name"]


@cpp_only
def test_output_in_place_over_another_lanes_input_stays_flat():
    """memory_plan may put a lane's output in the slot of another lane's input that dies here
    (element i is read before it is written in the flat loop): such lanes are merged."""
    b = GraphBuilder()
    x0, x1 = b.input(t((5, 5))), b.input(t((5, 5)))
    a0 = op(b, "exp.default", [x0], (In(0),), t((5, 5)))  # slot values, dying at the next kernel
    a1 = op(b, "neg.default", [x1], (In(0),), t((5, 5)))
    m = op(b, "mm.default", [a0, a1], (In(0), In(1)), t((5, 5)))  # keeps the kernels apart
    n = op(b, "mm.default", [a1, a0], (In(0), In(1)), t((5, 5)))
    y0 = op(b, "mul.Tensor", [m, a1], (In(0), In(1)), t((5, 5)))
    y1 = op(b, "mul.Tensor", [n, a0], (In(0), In(1)), t((5, 5)))
    z = op(b, "mm.default", [y0, y1], (In(0), In(1)), t((5, 5)))
    g = b.build([op(b, "mm.default", [z, a1], (In(0), In(1)), t((5, 5)))])  # a1 lives on
    run, _ = build(memory_plan(fuse(g)))
    g_ = torch.Generator().manual_seed(0)
    for _ in range(20):
        xs = [torch.randn(5, 5, generator=g_), torch.randn(5, 5, generator=g_)]
        # three GEMMs over Kiln's exp (2 ulp from ATen's) cancel in places: element-wise
        # relative error reached 2.5e-6 (CI) and 3.6e-4 (3,000 draws), while the error against
        # the result's scale stayed under 9e-7; an input overwritten before it is read would be
        # off by the scale itself
        for a, e in zip(run(xs), Interpreter(g)(xs)):
            assert float((a - e).abs().max()) <= 1e-5 * float(e.abs().max())


def _params_model() -> torch.nn.Module:
    """Many parameters of equal shapes (AdamW's per-parameter updates fuse horizontally), odd
    sizes and an empty one."""
    torch.manual_seed(3)
    layers = [torch.nn.Linear(7, 7) for _ in range(5)] + [torch.nn.Linear(7, 3)]
    model = torch.nn.Sequential(*layers)
    model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0, 7)))
    return model


_OPTS = [
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
    ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    *OPTIMIZERS,
]


@cpp_only
@pytest.mark.parametrize("make_opt", [m for _, m in _OPTS], ids=[i for i, _ in _OPTS])
def test_compiled_optimizer_with_lane_kernels_matches_eager(make_opt):
    from kiln.runtime.compiler import clear_memory_cache, executables

    torch._dynamo.reset()
    clear_memory_cache()  # every graph below is this test's
    model = _params_model()
    twin = copy.deepcopy(model)
    opts = [make_opt(model.parameters()), make_opt(twin.parameters())]
    eager, compiled = mse_step(model, opts[0]), kiln.compile(mse_step(twin, opts[1]))
    for _ in range(3):
        x, y = torch.randn(9, 7), torch.randn(9, 3)
        torch.testing.assert_close(compiled(x, y), eager(x, y))
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    for sa, sb in zip(opts[0].state.values(), opts[1].state.values()):
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                # (centered RMSprop's momentum differs by ~1e-5 relative in one element of 49
                # with lane kernels switched off too: fused rounding, not the lanes)
                torch.testing.assert_close(
                    sa[k], sb[k], rtol=1e-5, atol=1e-4, msg=lambda m, k=k: f"state {k}: {m}"
                )
    assert any(_lane_sources(e.info) for e in executables() if e.runs), "no lane kernel ran"
