"""Memory plan: fused outputs reuse dead buffers (in place where safe) and results stay exact."""

from __future__ import annotations

import torch
from kiln_codegen_testlib import op, t

from kiln.codegen.cpp import build
from kiln.ir.graph import GraphBuilder, In
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.passes.memory_plan import memory_plan
from kiln.codegen.interpreter import Interpreter


def _graph():
    """exp -> mm -> (tanh + prior) -> mm -> ... : pointwise values separated by matmuls."""
    b = GraphBuilder()
    x = b.input(t((16, 16)))
    w = b.input(t((16, 16)))
    h = op(b, "exp.default", (x,), (In(0),), t((16, 16)))
    for _ in range(3):
        m = op(b, "mm.default", (h, w), (In(0), In(1)), t((16, 16)))
        h = op(b, "tanh.default", (m,), (In(0),), t((16, 16)))
        h = op(b, "mul.Tensor", (h,), (In(0), 0.5), t((16, 16)))
    v = op(b, "view.default", (h,), (In(0), [256]), t((256,)))
    return b.build([v])


def test_slots_are_reused_and_results_match_over_steps():
    g = memory_plan(fuse(_graph()))
    places = [n.kwarg("placement") for n in g.nodes if n.op == "fused"]
    assert len(places) == 4
    slots = [p[0] for p in places]
    assert slots[-1] is None  # escapes through a view of the graph output
    assert len(set(s for s in slots if s is not None)) < len(slots) - 1  # some slot reused
    run, _ = build(g)
    ref = Interpreter(_graph())
    for _ in range(3):  # slot buffers persist across runs
        x, w = torch.randn(16, 16), torch.randn(16, 16) * 0.1
        (out,) = run([x, w])
        torch.testing.assert_close(out, ref([x, w])[0])


def test_pointwise_takes_dying_input_in_place(monkeypatch):
    # without rows epilogues: with them, the sub and the add join the row-sum kernel
    from kiln.passes import row_epilogue

    monkeypatch.setattr(row_epilogue, "ROW_EPILOGUE", False)
    b = GraphBuilder()
    x = b.input(t((8, 33)))
    y = b.input(t((33, 33)))
    e = op(b, "exp.default", (x,), (In(0),), t((8, 33)))
    m = op(b, "mm.default", (e, y), (In(0), In(1)), t((8, 33)))
    m = op(b, "neg.default", (m,), (In(0),), t((8, 33)))  # a fused value with a slot
    s = op(b, "sum.dim_IntList", (m,), (In(0), [-1], True), t((8, 1)))  # fused rows kernel
    d = op(b, "sub.Tensor", (m, s), (In(0), In(1)), t((8, 33)))
    a = op(b, "add.Tensor", (m, d), (In(0), In(1)), t((8, 33)))  # m dies here -> in place
    o = op(b, "mm.default", (a, y), (In(0), In(1)), t((8, 33)))
    g0 = b.build([o])
    g = memory_plan(fuse(g0))
    slot_of = {}
    for i, n in enumerate(g.nodes):
        if n.op == "fused" and len(n.types) == 1:
            slot_of[i] = n.kwarg("placement")[0]
        elif n.op == "getitem" and g.nodes[n.inputs[0]].op == "fused":
            slot_of[i] = g.nodes[n.inputs[0]].kwarg("placement")[n.args[1]]
    in_place = [
        i
        for i, n in enumerate(g.nodes)
        if n.op == "fused"
        and n.kwarg("kind") == "pointwise"
        and n.kwarg("placement")[0] is not None
        and any(slot_of.get(j) == n.kwarg("placement")[0] for j in n.inputs)
    ]
    assert in_place, str(g)
    run, _ = build(g)
    x, y = torch.randn(8, 33) * 0.1, torch.randn(33, 33) * 0.1
    torch.testing.assert_close(run([x, y])[0], Interpreter(g0)([x, y])[0])
