"""Input updates (``writeback``): kernels write the new value into the input in place when safe,
the writeback copies otherwise, and results always match eager."""

from __future__ import annotations

import copy

import pytest
import torch
from kiln_codegen_testlib import op, t
from optim_cases import OPTIMIZERS, check_compiled_step_matches_eager, mse_step

import kiln
from kiln.codegen.cpp import build
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.codegen.interpreter import Interpreter
from kiln.config import config
from kiln.ir.graph import GraphBuilder, In, Node
from kiln.passes.memory_plan import memory_plan


def _update_graph(read_old_later: bool = False):
    """p_new = p * 0.9 + g; writeback(p, p_new); optionally return a value of the old p."""
    b = GraphBuilder()
    p = b.input(t((8, 33)))
    g = b.input(t((8, 33)))
    m = op(b, "mul.Tensor", (p,), (In(0), 0.9), t((8, 33)))
    new = op(b, "add.Tensor", (m, g), (In(0), In(1)), t((8, 33)))
    outs = [op(b, "sum.default", (new,), (In(0),), t(()))]
    if read_old_later:
        mm = op(b, "permute.default", (p,), (In(0), [1, 0]), t((33, 8)))
        outs.append(op(b, "mm.default", (mm, g), (In(0), In(1)), t((33, 33))))
    b.add(Node("writeback", (p, new), (In(0), In(1)), (), b.nodes[p].types))
    return b.build(outs)


def _placements(g):
    return [n.kwarg("placement") for n in g.nodes if n.op == "fused"]


def test_plan_writes_the_update_into_the_input():
    g = memory_plan(fuse(_update_graph()))
    assert ("arg", 0) in [p[0] for p in _placements(g)]


def test_plan_keeps_the_input_when_its_old_value_is_read_later():
    g = memory_plan(fuse(_update_graph(read_old_later=True)))
    assert all(p is None or not isinstance(p, tuple) for pl in _placements(g) for p in pl)


def test_in_place_update_matches_interpreter_and_bumps_version():
    g = memory_plan(fuse(_update_graph()))
    run, _ = build(g)
    p, grad = torch.randn(8, 33), torch.randn(8, 33)
    p_ref = p.clone()
    Interpreter(_update_graph())([p_ref, grad])
    ptr, version = p.data_ptr(), p._version
    out = run([p, grad])
    torch.testing.assert_close(p, p_ref)
    torch.testing.assert_close(out[0], p_ref.sum())
    assert p.data_ptr() == ptr and p._version > version  # same buffer, autograd told


def test_non_contiguous_input_falls_back_to_a_copy():
    g = memory_plan(fuse(_update_graph()))
    run, _ = build(g)
    base = torch.randn(33, 8)
    p = base.t()  # (8, 33), not contiguous: the kernel cannot write into it
    grad = torch.randn(8, 33)
    expect = p * 0.9 + grad
    run([p, grad])
    torch.testing.assert_close(p, expect)
    before = kiln.metrics.get("input_update_copies")
    run([p, grad])
    torch.testing.assert_close(p, expect * 0.9 + grad)
    assert kiln.metrics.get("input_update_copies") == before + 1


def test_compiled_adamw_updates_parameters_in_place_and_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    twin = copy.deepcopy(model)

    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01)
    eager = mse_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    compiled = mse_step(twin, opt)
    compiled = kiln.compile(compiled)
    ptrs = None
    copies = kiln.metrics.get("input_update_copies")
    fallbacks = kiln.metrics.counters()["fallbacks"]
    for i in range(4):
        x, y = torch.randn(16, 12), torch.randn(16, 3)
        torch.testing.assert_close(compiled(x, y), eager(x, y))
        now = [p.data_ptr() for p in twin.parameters()] + [
            s["exp_avg"].data_ptr() for s in opt.state.values()
        ]
        if ptrs is not None:
            assert now == ptrs  # parameters and state keep their buffers
        ptrs = now
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    # step 1 creates the state (its own graph); later steps update everything in place (the C++
    # backend's memory plan lets kernels write into the inputs; other backends copy into them)
    if config.backend == "cpp":
        assert kiln.metrics.get("input_update_copies") == copies
    # ... in Kiln-compiled graphs, not in ATen graphs handed back to eager
    after = kiln.metrics.counters()["fallbacks"]
    assert not [k for k in after if k.startswith("graph:") and after[k] != fallbacks.get(k)]


def test_compiled_swap_of_two_inputs_reads_old_values():
    def swap(a, b):
        old = a.clone()
        a.copy_(b)
        b.copy_(old)
        c = a.add_(1)
        return c

    x, y = torch.randn(5), torch.randn(5)
    xe, ye = x.clone(), y.clone()
    ref = swap(xe, ye)
    with torch.no_grad():
        out = kiln.compile(swap)(x, y)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x, xe)
    torch.testing.assert_close(y, ye)


@pytest.mark.parametrize("make_opt", [m for _, m in OPTIMIZERS], ids=[i for i, _ in OPTIMIZERS])
def test_compiled_optimizers_match_eager(make_opt):
    check_compiled_step_matches_eager(make_opt, kiln.compile)


def test_read_of_an_updated_input_is_refused_not_reordered():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import Graph as FxGraph
    from torch.fx import GraphModule

    from kiln.frontends.compile.fx import UnsupportedGraph, fx_to_kiln

    fg = FxGraph()
    a, b = fg.placeholder("a"), fg.placeholder("b")
    mode = FakeTensorMode()
    with mode:
        a.meta["val"], b.meta["val"] = torch.empty(3), torch.empty(3)
    c = fg.call_function(torch.ops.aten.copy_.default, (a, b))
    d = fg.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))  # reads a after the update
    with mode:
        c.meta["val"], d.meta["val"] = torch.empty(3), torch.empty(3)
    fg.output((d,))
    with pytest.raises(UnsupportedGraph, match="after updating it"):
        fx_to_kiln(GraphModule(torch.nn.Module(), fg))


def test_copy_from_an_updated_input_is_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx import Graph as FxGraph
    from torch.fx import GraphModule

    from kiln.frontends.compile.fx import UnsupportedGraph, fx_to_kiln

    fg = FxGraph()
    a, b, x = fg.placeholder("a"), fg.placeholder("b"), fg.placeholder("x")
    mode = FakeTensorMode()
    with mode:
        for p in (a, b, x):
            p.meta["val"] = torch.empty(3)
    c1 = fg.call_function(torch.ops.aten.copy_.default, (a, x))
    c2 = fg.call_function(torch.ops.aten.copy_.default, (b, a))  # b gets a's *new* value
    with mode:
        c1.meta["val"], c2.meta["val"] = torch.empty(3), torch.empty(3)
    fg.output(())
    with pytest.raises(UnsupportedGraph, match="after updating it"):
        fx_to_kiln(GraphModule(torch.nn.Module(), fg))
