"""Graph breaks compiled in Dynamo's first pass (kiln/frontends/compile/known_breaks.py): a frame
that ends in ``loss.backward()`` or ``torch._dynamo.graph_break()`` gives the backend the same
graphs, with the same guards, and the program the same results and side effects, as when
Dynamo traces it a second time; failures inside inlined calls still restart; other backends are
left alone."""

from __future__ import annotations

import contextlib
import copy
import dis
import functools

import pytest
import torch
from _hf_models import tiny_gpt2_lm
from torch._dynamo import symbolic_convert
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

import kiln
from kiln.frontends.compile import backend as kiln_compile_backend
from kiln.frontends.compile.backend import kiln_backend


class _Recorder:
    """A backend that hands every graph to Kiln's and keeps its code; it is Kiln's backend to
    Kiln (``__wrapped__``), so Kiln's trace wrappers apply."""

    def __init__(self) -> None:
        self.codes: list[str] = []
        functools.update_wrapper(self, kiln_backend)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
        self.codes.append(gm.code)
        return kiln_backend(gm, example_inputs, **kwargs)


@contextlib.contextmanager
def _dynamo_restarts(restarts: bool):
    """With ``restarts``, Dynamo's own CALL handler back in place: it traces a frame a second
    time at every graph break (the baseline)."""
    table = symbolic_convert.InstructionTranslator.dispatch_table
    op = dis.opmap["CALL"]
    kiln.compile(lambda: None)  # Kiln's wrappers are installed in this process
    wrapper = table[op]
    assert hasattr(wrapper, "__kiln_wrapped__")
    install = kiln_compile_backend._compile_known_breaks_at_once
    if restarts:
        table[op] = wrapper.__kiln_wrapped__
        # Kiln's backend installs its wrappers again each time it runs: not now
        kiln_compile_backend._compile_known_breaks_at_once = lambda is_ours: False
    try:
        yield
    finally:
        table[op] = wrapper
        kiln_compile_backend._compile_known_breaks_at_once = install


def _compile(fn):
    """Compile ``fn`` fresh; return it and a function reporting (graph codes, guard counts per
    frame, retraces skipped, graph breaks)."""
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    rec = _Recorder()
    skipped = kiln.metrics.get("graph_break_retraces_skipped")

    def report():
        guards = [m.guard_count for m in get_compilation_metrics()]
        return (
            rec.codes,
            guards,
            kiln.metrics.get("graph_break_retraces_skipped") - skipped,
            sum(counters["graph_break"].values()),
        )

    return torch.compile(fn, backend=rec), report


def _train_program():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 24), torch.nn.LayerNorm(24), torch.nn.GELU(), torch.nn.Linear(24, 5)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, y):
        with torch.autocast("cpu", enabled=False):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, step


def test_training_step_same_graphs_guards_and_numbers_as_a_second_pass():
    torch.manual_seed(1)
    batches = [(torch.randn(8, 12), torch.randint(0, 5, (8,))) for _ in range(3)]
    results = {}
    for first_pass in (False, True):
        model, step = _train_program()
        compiled, report = _compile(step)
        with _dynamo_restarts(not first_pass):
            losses = [compiled(x, y) for x, y in batches]
        results[first_pass] = (losses, [p.detach().clone() for p in model.parameters()], report())
    model, step = _train_program()
    eager = [step(x, y) for x, y in batches]
    (l0, p0, (codes0, guards0, skip0, _)), (l1, p1, (codes1, guards1, skip1, _)) = (
        results[False],
        results[True],
    )
    assert skip0 == 0 and skip1 >= 1  # loss.backward() compiled in the first pass
    assert codes1 == codes0
    assert guards1 == guards0
    for a, b, e in zip(l0, l1, eager):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(b, e)
    for a, b, e in zip(p0, p1, model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(b, e.detach())


class _Box:
    count = 0


def _with_side_effects(x, w, seen, box):
    y = (x * w).sin()
    seen.append(y.sum().detach())
    box.count += 1
    with torch.no_grad():
        z = y * 2
    y.square().sum().backward()
    return (z + 1).cos(), box.count


def _backward(loss):
    loss.backward()
    return loss.detach()


def _inlined_break(x, w, seen, box):
    return _backward((x * w).exp().sum()) * 2, box.count


def _with_keywords(x, w, seen, box):
    loss = (x * w).tanh().sum()
    loss.backward(retain_graph=True)  # in the frame, then again in its resume function
    loss.backward(inputs=[w])
    return loss.detach() * 2, box.count


# first-pass compiles: side effects, one per call (Dynamo guards on ``seen``'s length, which
# grows); inlined, one: the caller restarts, then ``_backward`` is compiled as a frame of its own;
# keywords: the frame's (its resume function's ``backward(inputs=[w])`` attempt adds to the trace,
# so that one restarts)
@pytest.mark.parametrize(
    "fn,skips",
    [(_with_side_effects, 2), (_inlined_break, 1), (_with_keywords, 1)],
    ids=["side effects", "inlined", "keywords"],
)
def test_backward_break_matches_second_pass_and_eager(fn, skips):
    """Side effects and a grad-mode block before the break; a break inside an inlined call
    restarts (a failed inlining may have traced half the callee)."""
    x = torch.randn(5)
    results = {}
    for mode in ("second pass", "first pass", "eager"):
        w = torch.ones(5, requires_grad=True)
        seen, box = [], _Box()
        run, report = (fn, None) if mode == "eager" else _compile(fn)
        with _dynamo_restarts(mode == "second pass"):
            out = [run(x, w, seen, box) for _ in range(2)]
        results[mode] = ((out, seen, box.count, w.grad), report and report())
    for mode in ("second pass", "first pass"):
        torch.testing.assert_close(results[mode][0], results["eager"][0])
    (codes0, guards0, skip0, _), (codes1, guards1, skip1, _) = (
        results["second pass"][1],
        results["first pass"][1],
    )
    assert codes1 == codes0
    assert guards1 == guards0
    assert skip0 == 0 and skip1 == skips


def test_other_backends_restart_as_torch_does():
    _, step = _train_program()
    compiled = torch.compile(step, backend="aot_eager")
    kiln.compile(lambda: None)
    torch._dynamo.reset()
    before = kiln.metrics.get("graph_break_retraces_skipped")
    x, y = torch.randn(4, 12), torch.randint(0, 5, (4,))
    _, eager_step = _train_program()
    torch.testing.assert_close(compiled(x, y), eager_step(x, y))
    assert kiln.metrics.get("graph_break_retraces_skipped") == before


def test_gpt2_step_graphs_unchanged():
    """A real model's step (transformers GPT-2, library defaults but dropout 0): the same Kiln
    graphs and guards as with Dynamo's second pass, the same losses and parameters."""
    torch.manual_seed(0)
    base = tiny_gpt2_lm()
    ids = [torch.randint(0, 97, (2, 16)) for _ in range(2)]
    runs = {}
    for first_pass in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i, model=model, opt=opt):
            loss = model(input_ids=i, labels=i).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        compiled, report = _compile(step)
        with _dynamo_restarts(not first_pass):
            losses = [compiled(i) for i in ids]
        runs[first_pass] = (losses, list(model.parameters()), report())
    assert runs[True][2][0] == runs[False][2][0]
    assert runs[True][2][1] == runs[False][2][1]
    assert runs[True][2][2] >= 1
    for a, b in zip(runs[False][0], runs[True][0]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for a, b in zip(runs[False][1], runs[True][1]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _sum_loss_step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize(
    "make_x",
    [lambda: torch.randn(12, 6).t(), lambda: torch.randn(0, 12)],
    ids=["non-contiguous", "zero-size"],
)
def test_odd_batches_match_second_pass_and_eager(make_x):
    """A transposed (non-contiguous) batch and an empty one (a summed loss: 0 and zero
    gradients, as eager), SGD with momentum so that the parameters show every gradient."""
    torch.manual_seed(2)
    x = make_x()
    y = torch.randint(0, 5, (x.shape[0],))
    base = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    results = {}
    for mode in ("second pass", "first pass", "eager"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if mode == "eager":
            run, report = _sum_loss_step, None
        else:
            run, report = _compile(_sum_loss_step)
        with _dynamo_restarts(mode == "second pass"):
            losses = [run(model, opt, x, y) for _ in range(2)]
        results[mode] = ((losses, list(model.parameters())), report and report())
    for mode in ("second pass", "first pass"):
        torch.testing.assert_close(results[mode][0], results["eager"][0])
    assert results["first pass"][1][:2] == results["second pass"][1][:2]  # graphs, guards
    assert results["first pass"][1][2] >= 1 and results["second pass"][1][2] == 0
