"""The step logic both frontends share (kiln/runtime/steps.py, kiln/runtime/writebacks.py): call-site
names, recompile reasons, writebacks, KILN_MAX_STEPS."""

from __future__ import annotations

import os

import pytest
import torch

import kiln
from kiln import metrics
from kiln.ir.graph import GraphBuilder, In, Node, TensorType
from kiln.runtime import steps
from kiln.runtime.steps import Recompiles, Signature, call_site, stack_trace_frames
from kiln.runtime.writebacks import Update, add_writebacks

KILN_FILE = kiln.__file__
TORCH_FILE = torch.nn.Linear.forward.__code__.co_filename


def test_call_site_is_the_first_user_frame():
    frames = [(KILN_FILE, 10), (TORCH_FILE, 20), ("/home/u/torchy/train.py", 7), ("/x.py", 1)]
    assert call_site("lazy", frames) == "lazy:/home/u/torchy/train.py:7"
    assert call_site("lazy", [(KILN_FILE, 1), (TORCH_FILE, 2)]) is None


def test_stack_trace_frames_innermost_first():
    text = (
        'File "/home/u/train.py", line 12, in step\n    loss = model(x)\n'
        f'File "{TORCH_FILE}", line 125, in forward\n    return F.linear(x)\n'
    )
    frames = stack_trace_frames(text)
    assert frames == [(TORCH_FILE, 125), ("/home/u/train.py", 12)]
    assert call_site("compile", frames) == "compile:/home/u/train.py:12"


def test_recompile_reasons():
    metrics.reset()
    r = Recompiles()
    a = Signature(("f32[2]", "int"), "h1", 5)
    r.seen("s", a)  # first graph at the site: not a recompile
    r.seen("s", a)
    r.seen("s", Signature(("f32[3]", "int"), "h2", 5), compiled=False)  # memory-cache hit
    assert metrics.get("recompiles") == 0
    r.seen("s", Signature(("f32[4]", "int"), "h3", 5))
    r.seen("s", Signature(("f32[4]",), "h4", 4))
    r.seen("s", Signature(("f32[4]",), "h5", 6))
    r.seen("t", Signature(("f32[4]",)))
    r.seen("t", Signature(("f32[4]",)))  # same inputs, no graph identity: not counted
    assert metrics.counters()["recompile_reasons"] == [
        ("s", "input 0 changed f32[3] -> f32[4]"),
        ("s", "number of inputs changed 2 -> 1"),
        ("s", "graph structure changed (4 -> 6 nodes)"),
    ]


def test_the_recompile_warning_advises_on_what_changed():
    """The warning's advice follows the reason: padding for new shapes, one dtype for a new
    dtype, and for another graph with the same inputs (the lazy device's code taking another
    branch) not padding, which would not help, but where to cut the step."""
    f32, f64 = torch.float32, torch.float64
    lazy = Signature((TensorType((2, 8), f32),), "h1", 5)
    shapes = steps.recompile_advice("lazy:t.py:1", lazy, Signature((TensorType((3, 8), f32),)))
    assert "pad inputs to a few fixed sizes" in shapes
    dtypes = steps.recompile_advice("lazy:t.py:1", lazy, Signature((TensorType((2, 8), f64),)))
    assert dtypes.startswith("Each new dtype is a new graph") and "pad" not in dtypes
    branch = steps.recompile_advice("lazy:t.py:1", lazy, Signature(lazy.inputs, "h2", 7))
    assert "pad" not in branch and "kiln.mark_step()" in branch
    compiled = Signature((((2, 8), f32), "int"))
    grown = Signature((((2, 8), f32), "int", "int"))
    assert "mark_step" not in steps.recompile_advice("compile:m.py:3", compiled, grown)
    assert "pad inputs" in steps.recompile_advice(
        "compile:m.py:3", compiled, Signature((((2, 9), f32), "int"))
    )
    metrics.reset()
    r = Recompiles()
    r.seen("lazy:t.py:9", lazy)
    with (
        kiln.config.scoped(recompile_warn=0),
        pytest.warns(metrics.RecompileWarning, match="graph structure changed") as w,
    ):
        r.seen("lazy:t.py:9", Signature(lazy.inputs, "h2", 7))
    assert "pad inputs" not in str(w[0].message) and "mark_step" in str(w[0].message)


def test_writebacks_clone_or_skip_aliased_sources():
    t = (TensorType((3,), torch.float32),)
    for clone in (False, True):
        b = GraphBuilder()
        x, y = b.input(t[0]), b.input(t[0])
        fresh = b.add(Node("add.Tensor", (x, y), (In(0), In(1)), (), t))
        view = b.add(Node("alias.default", (y,), (In(0),), (), t))
        other = b.add(Node("sum.default", (x,), (In(0),), (), (TensorType((), torch.float32),)))
        ups = [Update(x, fresh, True), Update(y, view, False), Update(x, other, True)]
        if clone:
            ups.pop()  # compile mode vouches for matching types
        ids = add_writebacks(b, ups, clone_aliased=clone)
        ops = [b.nodes[i].op for i in range(len(b.nodes))]
        if clone:  # the aliased source is cloned before any writeback runs
            assert ops[-3:] == ["clone.default", "writeback", "writeback"]
            assert b.nodes[ids[1]].inputs == (y, len(ops) - 3)
        else:  # not written back: the lazy tensor takes the value as a new buffer
            assert ids[1:] == [None, None] and ops.count("writeback") == 1
        assert b.nodes[ids[0]].inputs == (x, fresh)


def test_max_steps_stops_cleanly(capsys):
    kiln.config.update(max_steps=2)
    try:
        steps.step_end(1)
        with pytest.raises(SystemExit) as e:
            steps.step_end(2)
        assert e.value.code == 0
        assert "stopping after 2 steps (KILN_MAX_STEPS)" in capsys.readouterr().err
    finally:
        kiln.config.update(max_steps=0)


def test_compile_recompile_names_the_user_line():
    torch._dynamo.reset()
    metrics.reset()

    @torch.compile(backend="kiln", dynamic=False)
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    for n in (3, 4):
        torch.testing.assert_close(f(torch.ones(n)), torch.full((n,), 3.0))
    ((site, reason),) = metrics.counters()["recompile_reasons"]
    assert site.startswith(f"compile:{os.path.abspath(__file__)}:"), site
    assert reason.startswith("input 0 changed")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.lin(x)))


def test_an_eval_loop_under_no_grad_is_not_a_recompile_of_the_training_graphs():
    """Training a compiled model and evaluating it under ``no_grad`` each epoch makes training
    graphs (forward, backward) and an inference graph at the same line: each kind is its own
    recompile site, so nothing is counted (the inference graph, with the same number of inputs
    as the training forward, was compared with it and counted, with the warning's advice to pad
    inputs); a new batch size in training still is."""
    torch._dynamo.reset()
    metrics.reset()
    torch.manual_seed(0)
    model = _Net()  # its forward is this file's line: the site (not a generic module's)
    compiled = torch.compile(model, backend="kiln", dynamic=False)
    for _ in range(3):
        model.train()
        compiled(torch.randn(4, 6)).sum().backward()
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x := torch.randn(4, 6)), model(x))
    assert metrics.get("recompiles") == 0, metrics.counters()["recompile_reasons"]
    model.train()
    compiled(torch.randn(5, 6)).sum().backward()
    reasons = metrics.counters()["recompile_reasons"]
    assert reasons and all("#forward#" in site or "#backward#" in site for site, _ in reasons)
    assert all(site.startswith(f"compile:{os.path.abspath(__file__)}:") for site, _ in reasons)


def test_the_step_count_reads_zero_before_the_first_step():
    """``kiln.metrics.counters()["steps"]`` is 0 until a step ends (it was missing: None from
    ``.get``, a KeyError from ``[]``), also after a reset."""
    from kiln import metrics

    metrics.reset()
    assert metrics.counters()["steps"] == 0
    metrics.step_done()
    assert metrics.counters()["steps"] == 1
    metrics.reset()
    assert metrics.counters()["steps"] == 0
