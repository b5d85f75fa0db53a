"""Shape-generic graphs on the native recorder (docs/native_recorder.md, stage 7): per new native
graph id, :mod:`kiln.frontends.lazy.dynamic` decides once on its converted graph whether a
shape-generic graph of its family runs it (with the symbol ints passed at run time); recompiles
are counted and named per call site; explicit steps end a step.  Every result, gradient and
updated parameter is compared with eager PyTorch."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import native_device  # noqa: F401 - the module fixture
from torch import nn

import kiln
from kiln import metrics
from kiln.frontends.lazy import dynamic, native

dev = kiln.device()
VOCAB, DIM, HEADS = 29, 24, 3

pytestmark = pytest.mark.usefixtures("native_device")


@pytest.fixture(autouse=True)
def _fresh_families():
    """Each test sees its own families of graphs (the counts below start from nothing)."""
    kiln.mark_step()
    dynamic.clear()


class _GPT(nn.Module):
    """A one-block GPT: token and position embeddings, causal attention, GELU MLP, tied-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(80, DIM)
        self.ln1, self.ln2, self.ln = nn.LayerNorm(DIM), nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, L = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(L, device=idx.device))
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=2)
        q, k, v = (t.view(B, L, HEADS, DIM // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, DIM))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln(x))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, idx, y):
    logits = model(idx)
    # summed over tokens: a mean over zero tokens is NaN in eager as well
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return loss, grads


def _compiles() -> int:
    return metrics.get("graphs_compiled") + metrics.get("cache_hits_disk")


class _Pair:
    """An eager model and its copy on the native device, trained side by side with AdamW
    (library defaults: the foreach path on the kiln device), compared after every step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.ref = _GPT()
        self.lz = copy.deepcopy(self.ref).to(dev)
        assert all(native.is_native(p) for p in self.lz.parameters())
        self.opt_r = torch.optim.AdamW(self.ref.parameters(), lr=1e-2)
        self.opt_l = torch.optim.AdamW(self.lz.parameters(), lr=1e-2)

    def step(self, length: int, batch: int = 2) -> None:
        idx = torch.randint(0, VOCAB, (batch, length))
        y = torch.randint(0, VOCAB, (batch, length))
        loss_r, grads_r = _train_step(self.ref, self.opt_r, idx, y)
        loss_l, grads_l = _train_step(self.lz, self.opt_l, idx.to(dev), y.to(dev))
        kiln.mark_step()
        where = f"(sequence length {length}, batch {batch})"
        torch.testing.assert_close(
            loss_l.cpu(), loss_r.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{m}\n{where}"
        )
        for gr, gl in zip(grads_r, grads_l):
            torch.testing.assert_close(
                gl.cpu(), gr, rtol=1e-4, atol=1e-5, msg=lambda m: f"{m}\n{where}"
            )
        for p, q in zip(self.ref.parameters(), self.lz.parameters()):
            torch.testing.assert_close(
                q.cpu(), p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{m}\n{where}"
            )


def test_ten_sequence_lengths_train_on_at_most_two_graphs_and_match_eager(monkeypatch):
    pair = _Pair()
    pair.step(7)  # the first step creates AdamW's state: a graph of its own
    metrics.reset()
    lengths = [7, 12, 5, 33, 9, 2, 17, 64, 3, 10]
    for length in lengths:
        pair.step(length)
    # the steady step at its first length, then one shape-generic graph for all the others
    assert _compiles() <= 2, metrics.counters()
    assert metrics.get("shape_generic_graphs") == 1
    assert metrics.get("shape_generic_reuses") == len(set(lengths)) - 1
    # one per compile (the first length follows AdamW's first step; the generic graph), no storm
    reasons = metrics.counters()["recompile_reasons"]
    assert len(reasons) <= 2 and metrics.get("recompiles") == len(reasons), reasons
    assert not [f for f in metrics.counters()["fallbacks"] if "contract" in f]
    # a length seen before is a graph id seen before: no new decision, no compile
    calls: list[int] = []
    real = dynamic.choose
    monkeypatch.setattr(dynamic, "choose", lambda g: calls.append(1) or real(g))
    before = _compiles()
    for length in (12, 33, 12):
        pair.step(length)
    assert calls == [] and _compiles() == before


def test_sizes_zero_and_one_get_their_own_graph():
    pair = _Pair()
    pair.step(6)
    pair.step(6)
    pair.step(9)  # the generic graph
    metrics.reset()
    for length in (1, 0):  # never symbolic (as in Dynamo): each compiles on its own, still exact
        before = _compiles()
        pair.step(length)
        assert _compiles() == before + 1, length
    before = _compiles()
    pair.step(1)
    pair.step(0)
    pair.step(11)  # seen-before sizes and a new length the generic graph serves: no compile
    assert _compiles() == before
    assert metrics.get("shape_generic_reuses") == 1


# Each test's programs carry a float no other test uses (a layer norm's eps, a clamp bound: kept in
# the node), so their graphs are new to the process's compile cache and every compile is counted.
def _norm_step(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x * 2 + 1, x.shape[-1:], eps=3.0625e-5).relu().sum(1)


def _run(fn, x: torch.Tensor) -> None:
    got = fn(x.to(dev))
    kiln.mark_step()
    want = fn(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want)


def test_a_dtype_change_is_a_new_graph():
    metrics.reset()
    for length in (5, 7):
        _run(_norm_step, torch.randn(3, length, 4))
    assert metrics.get("shape_generic_graphs") == 1
    before = _compiles()
    _run(_norm_step, torch.randn(3, 9, 4, dtype=torch.float64))  # not served the float32 graph
    assert _compiles() == before + 1 and metrics.get("shape_generic_reuses") == 1
    _run(_norm_step, torch.randn(3, 11, 4, dtype=torch.float64))  # float64's own generic graph
    assert metrics.get("shape_generic_graphs") == 2
    before = _compiles()
    _run(_norm_step, torch.randn(3, 13, 4))
    _run(_norm_step, torch.randn(3, 6, 4, dtype=torch.float64))
    assert _compiles() == before and metrics.get("shape_generic_reuses") == 4


@pytest.mark.filterwarnings("ignore::kiln.metrics.RecompileWarning")  # six shapes at one line
def test_changes_that_cannot_be_generalised_are_still_correct():
    metrics.reset()
    # the reduced dim is an ``int`` argument (a dim index), never symbolic; an int multiplier is
    # a constant of the node; both compile on their own
    for shape, dim, k in (((2, 3, 4, 5), 2, 2), ((2, 3, 4, 6), 3, 2), ((2, 3, 4, 7), 3, 3)):
        _run(lambda t, dim=dim, k=k: (t.clamp(min=-2.6875) * k).sum(dim), torch.randn(shape))
    assert metrics.get("shape_generic_refused") == 2
    assert metrics.get("shape_generic_graphs") == 0
    # a non-contiguous input whose strides change with the length
    for length in (4, 6, 11):
        x = torch.randn(length, 3, 5).transpose(0, 2)
        _run(lambda t: (t.reshape(15, t.shape[-1]).clamp(max=2.8125) * 3).softmax(-1)[:, 1:], x)
    assert metrics.get("shape_generic_reuses") == 2  # lengths 6 (making the graph) and 11


def test_the_switch_off_is_one_graph_per_shape_and_is_decided_again_when_flipped():
    kiln.config.update(dynamic_shapes=False)
    try:
        metrics.reset()
        for length in (21, 22, 23):
            _run(lambda t: (t.clamp(min=-0.5625) * 2).sum(), torch.ones(length))
        assert _compiles() == 3 and metrics.get("shape_generic_graphs") == 0
    finally:
        kiln.config.update(dynamic_shapes=True)
    _run(lambda t: (t.clamp(min=-0.5625) * 2).sum(), torch.ones(22))  # the same id: decided again
    _run(lambda t: (t.clamp(min=-0.5625) * 2).sum(), torch.ones(24))
    assert metrics.get("shape_generic_graphs") == 1


def _five_lengths() -> None:
    for n in range(2, 7):
        x = torch.ones(n).to(dev)
        s = (x.clamp(min=-0.4375) * 2).sum()
        kiln.mark_step()
        assert s.item() == 2 * n


def test_recompiles_are_counted_at_the_users_line_and_name_the_input():
    metrics.reset()
    kiln.config.update(recompile_warn=2, dynamic_shapes=False)
    try:
        with pytest.warns(metrics.RecompileWarning, match="input 0 changed"):
            _five_lengths()
    finally:
        kiln.config.update(recompile_warn=4, dynamic_shapes=True)
    reasons = metrics.counters()["recompile_reasons"]
    assert len(reasons) == 4
    for site, reason in reasons:
        assert site.startswith(f"lazy:{__file__}:"), site
        assert reason.startswith("input 0 changed"), reason


def test_explicit_steps_end_a_step_and_forced_syncs_do_not():
    x = torch.randn(5).to(dev)
    kiln.mark_step()
    steps = metrics.get("steps")
    y = x * 3
    want, tol = float((x.cpu() * 3).sum()), 3e-6 * float(x.cpu().abs().sum())  # summation order
    assert y.sum().item() == pytest.approx(want, abs=tol)  # forced
    assert metrics.get("steps") == steps
    z = y + 1
    kiln.mark_step()
    assert metrics.get("steps") == steps + 1
    torch.testing.assert_close(z.cpu(), x.cpu() * 3 + 1)


def test_native_recorder_is_the_one_running():
    # guard for the tests above: they must exercise the native path, not the Python recorder
    assert kiln.config.lazy_recorder == "native"
    assert native.is_native(torch.ones(2, device=dev))
    assert "kiln.frontends.lazy.native" in sys.modules


def test_max_steps_stops_after_that_many_explicit_steps(capsys):
    # KILN_MAX_STEPS (kiln precompile): the process ends cleanly at the N-th explicit step
    metrics.reset()
    x = torch.randn(6).to(dev)
    kiln.config.update(max_steps=metrics.get("mark_steps") + 2)
    try:
        kiln.mark_step()  # step 1 (the upload: nothing to run)
        y = x * 3
        y.sum().item()  # a forced sync: not a step
        z = y - 1
        with pytest.raises(SystemExit) as e:
            kiln.mark_step()  # step 2
        assert e.value.code == 0
        assert "stopping after" in capsys.readouterr().err
    finally:
        kiln.config.update(max_steps=0)
    torch.testing.assert_close(z.cpu(), x.cpu() * 3 - 1)  # the step's results were assigned
