"""The pass pipeline on real training steps captured by ``torch.compile(backend="kiln")``.

An MLP and a small transformer block (layer norm, softmax attention, GELU, dropout with p=0) train
for a few steps compiled and eagerly from the same weights; losses, outputs and gradients must agree
with the pipeline on, and with each pass switched off by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
import kiln.frontends.compile.backend as kiln_backend
from kiln.config import config
from kiln.ir import verify
from kiln.passes.pipeline import PIPELINE_NAMES, run_pipeline
from kiln.runtime.compiler import clear_memory_cache
from kiln.codegen.interpreter import Interpreter

_SETTINGS = ("backend", "disk_cache", "checks", "disable_passes")
# The graph-optimization passes under test.  Codegen passes after them (``fuse``) make nodes only
# the C++ backend runs, so they are switched off here: the reference interpreter runs the graphs.
OPT_PASSES = ["simplify", "layout", "rotate", "sink_permute", "constant_fold", "cse", "dce"]
CODEGEN_OFF = ",".join(n for n in PIPELINE_NAMES if n not in OPT_PASSES)


@pytest.fixture(autouse=True)
def kiln_settings():
    saved = {k: getattr(config, k) for k in _SETTINGS}
    config.update(backend="interpreter", disk_cache=False, checks=True, disable_passes=CODEGEN_OFF)
    clear_memory_cache()
    torch._dynamo.reset()
    yield
    config.update(**saved)
    clear_memory_cache()
    torch._dynamo.reset()


@pytest.fixture
def captured(monkeypatch):
    """Every (graph, executable) the torch.compile backend compiles during the test."""
    seen: list = []
    real = kiln_backend.compile_graph

    def recording(g):
        exe = real(g)
        seen.append((g, exe))
        return exe

    monkeypatch.setattr(kiln_backend, "compile_graph", recording)
    return seen


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(torch.nn.Module):
    """Pre-norm transformer block: multi-head self-attention and a GELU MLP."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(p=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def _train_and_compare(model: torch.nn.Module, make_input, steps: int = 3) -> None:
    torch.manual_seed(0)
    eager = model
    compiled_model = copy.deepcopy(model)
    step = torch.compile(lambda m, x, y: F.mse_loss(m(x), y), backend="kiln")
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.05)
    for _ in range(steps):
        x, y = make_input()
        want = F.mse_loss(eager(x), y)
        got = step(compiled_model, x, y)
        torch.testing.assert_close(got, want)
        want.backward()
        got.backward()
        for (name, pe), pc in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, msg=f"gradient of {name} differs")
        opt_e.step()
        opt_c.step()
        opt_e.zero_grad()
        opt_c.zero_grad()
    with torch.no_grad():
        x, _ = make_input()
        torch.testing.assert_close(compiled_model(x), eager(x))


def _mlp_data():
    return torch.randn(8, 16), torch.randn(8, 4)


def _block_data():
    return torch.randn(2, 5, 16), torch.randn(2, 5, 16)


def _check_optimized(captured) -> list[tuple[int, int]]:
    """Every compiled graph verifies, computes what its source computes, and did not grow."""
    assert captured, "torch.compile did not reach the Kiln backend"
    sizes = []
    for g, exe in captured:
        verify(exe.graph, deep=True)
        assert len(exe.graph) <= len(g)
        sizes.append((len(g), len(exe.graph)))
    return sizes


def test_mlp_training_matches_eager(captured):
    torch.manual_seed(0)
    _train_and_compare(MLP(), _mlp_data)
    sizes = _check_optimized(captured)
    assert any(after < before for before, after in sizes), sizes


def test_transformer_block_training_matches_eager(captured):
    torch.manual_seed(0)
    # the compile frontend drops dropout(p=0) before AOTAutograd (its dropout rewrite); off here,
    # so that the graphs hold AOTAutograd's clones for the passes to remove
    config.update(disable_passes="dropout")
    try:
        _train_and_compare(Block(), _block_data)
    finally:
        config.update(disable_passes="")
    sizes = _check_optimized(captured)
    assert any(after < before for before, after in sizes), sizes
    # The forward graph's dropout(p=0) clones and same-shape views are gone.
    fw = captured[0][1].graph
    assert fw.count(lambda n: n.op.startswith("clone")) < captured[0][0].count(
        lambda n: n.op.startswith("clone")
    )


def _disable(*names: str) -> None:
    config.update(disable_passes=",".join(n for n in (*names, CODEGEN_OFF) if n))


@pytest.mark.parametrize("name", OPT_PASSES)
def test_each_pass_can_be_switched_off(name, captured):
    _disable(name)
    torch.manual_seed(0)
    _train_and_compare(MLP(), _mlp_data, steps=2)
    _check_optimized(captured)
    g = captured[0][0]
    trace: list = []
    run_pipeline(g, trace)
    ran = [n for n, _, _ in trace]
    assert name not in ran
    assert ran == [n for n in OPT_PASSES if n != name]


def test_all_passes_off_leaves_the_graph_alone(captured):
    torch.manual_seed(0)
    _train_and_compare(MLP(), _mlp_data, steps=1)
    g = captured[0][0]
    _disable(*OPT_PASSES)
    assert run_pipeline(g) is g
    _disable()
    opt = run_pipeline(g)
    ins = [torch.randn(g.nodes[i].types[0].shape) for i in g.inputs]
    for w, o in zip(Interpreter(g)(list(ins)), Interpreter(opt)(list(ins))):
        torch.testing.assert_close(o, w)


def test_kiln_compile_is_the_same_backend():
    assert kiln.compile is not None and "kiln" in torch._dynamo.list_backends()
