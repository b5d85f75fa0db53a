"""Products over several batch dims -> ``kiln::matmul_strided`` (kiln/frontends/compile/
strided_matmul.py, and the attention chain of short_attention.py): which calls are rewritten,
with which result layout, and that a hand-written attention layer trained through
``backend="kiln"`` equals eager in loss, every gradient and the parameters after AdamW steps
(odd sizes, the benchmark's size, and with the rewrite off)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from kiln import metrics
from kiln.config import config
from kiln.frontends.compile.short_attention import _attention_chain
from kiln.frontends.compile.strided_matmul import strided_matmuls
from kiln.ir.matmul_strided import OP
from tests.frontends._dynamo_rewrites import rewritten
from tests.frontends._training_compare import assert_same_training

STRIDED = "matmul_strided.default"


def _heads(b=2, t=5, h=3, e=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, 3 * h * e, generator=g)
    return [p.view(b, t, h, e).transpose(1, 2) for p in x.split(h * e, dim=2)]


def _attend(q, k, v):
    att = torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1)), dim=-1)
    y = att @ v
    return y.transpose(1, 2).contiguous().view(q.size(0), q.size(2), q.size(1) * v.size(-1))


# ---- which calls are taken -------------------------------------------------------------------


def test_both_products_become_the_op_and_the_second_takes_its_readers_layout():
    seen = rewritten(strided_matmuls, _attend, *_heads())
    assert seen["n"] == 2 and seen["meta"]
    assert seen["ops"].count(str(OP)) + seen["ops"].count(OP.__name__) == 2
    assert "matmul" not in seen["ops"]


def test_order_follows_a_transpose_or_permute_reader():
    orders = []

    def record(gm):
        n = strided_matmuls(gm)
        orders.extend(x.args[2] for x in gm.graph.nodes if x.target is OP)
        return n

    q, k, _ = _heads()
    rewritten(record, lambda q, k: (q @ k.transpose(-2, -1)).permute(0, 2, 1, 3), q, k)
    rewritten(record, lambda q, k: torch.matmul(q, k.transpose(-2, -1)).transpose(1, 2), q, k)
    rewritten(record, lambda q, k: q.matmul(k.transpose(-2, -1)).transpose(-1, -2), q, k)
    rewritten(record, lambda q, k: (q @ k.transpose(-2, -1)) * 2, q, k)
    # a permute that moves the last dim, and a result read twice, keep the row-major layout
    assert orders == [[0, 2, 1, 3], [0, 2, 1, 3], None, None]


@pytest.mark.parametrize(
    "a,b",
    [
        (torch.randn(2, 3, 4, 5), torch.randn(1, 3, 5, 6)),  # broadcast batch dims
        (torch.randn(3, 4, 5), torch.randn(3, 5, 6)),  # rank 3: bmm reads strides already
        (torch.randn(2, 3, 4, 5).double(), torch.randn(2, 3, 5, 6).double()),  # not float32
        (torch.randn(2, 3, 4, 5), torch.randn(5, 6)),  # a matrix operand
    ],
)
def test_other_products_stay(a, b):
    seen = rewritten(strided_matmuls, lambda a, b: a @ b, a, b)
    assert seen["n"] == 0


def test_autocast_graphs_stay():
    def f(q, k):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return q @ k.transpose(-2, -1)

    assert rewritten(strided_matmuls, f, *_heads()[:2])["n"] == 0


def test_the_attention_chain_uses_the_op_except_under_grouped_query_heads():
    q, k, v = _heads()
    g = make_fx(lambda q, k, v: _attention_chain(q, k, v, None, True, 0.5))(q, k, v)
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert targets.count("kiln.matmul_strided.default") == 2 and "aten.bmm.default" not in targets
    kv = k[:, :1], v[:, :1]
    g = make_fx(lambda q, k, v: _attention_chain(q, k, v, None, True, 0.5))(q, *kv)
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert "kiln.matmul_strided.default" not in targets


# ---- training through backend="kiln" vs eager -------------------------------------------------


class _Block(nn.Module):
    """nanoGPT's attention, written out: fused q/k/v projection, causal mask buffer."""

    def __init__(self, c: int, h: int, t: int) -> None:
        super().__init__()
        self.h = h
        # no bias: a key bias only shifts each row's scores, which the softmax cancels, so its
        # gradient is rounding noise that AdamW turns into full steps (any summation order,
        # ATen's own included, then gives other parameters)
        self.qkv = nn.Linear(c, 3 * c, bias=False)
        self.proj = nn.Linear(c, c)
        self.register_buffer("mask", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return x + self.proj(y)


def _train(model, step_fn, xs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for x in xs:
        loss = step_fn(model, x)
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), grads, [p.detach().clone() for p in model.parameters()]


def _replayed(model: nn.Module, grads: list) -> list:
    """Eager AdamW over ``init`` fed the given gradients, step by step: AdamW's first steps are
    ~lr * g / |g|, so an element whose gradient is rounding noise moves by a good part of a step
    whatever the summation order; the compiled run's parameters are checked against eager's
    optimizer applied to its own gradients (a wrong scale or a missed update shows), and its
    gradients against eager's."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _loss(model, x):
    return (model(x) ** 2).mean()


@pytest.mark.parametrize(
    "b,t,c,h,rewrites",
    [(3, 13, 15, 3, 2), (8, 64, 128, 4, 2), (3, 13, 15, 3, 0)],
    ids=["odd", "benchmark", "off"],
)
def test_training_equals_eager(b, t, c, h, rewrites):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(_Block(c, h, t), _Block(c, h, t))
    eager_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, t, c, generator=g) for _ in range(3)]
    before = metrics.counters().get("strided_matmuls", 0)
    off = "strided_matmul" if rewrites == 0 else ""
    with config.scoped(disable_passes=off):
        got = _train(model, torch.compile(_loss, backend="kiln"), xs)
    # two blocks, two products each, in the one graph Dynamo captures
    assert metrics.counters().get("strided_matmuls", 0) - before == 2 * rewrites
    replayed = _replayed(copy.deepcopy(eager_model), got[1])
    want = _train(eager_model, _loss, xs)
    # losses and every step's gradients against eager's; parameters against eager's AdamW
    # applied to the compiled run's gradients
    assert_same_training(got, (want[0], want[1], replayed))


@pytest.mark.parametrize("batch,t", [(0, 5), (2, 0)], ids=["no_batch", "no_tokens"])
def test_zero_size(batch, t):
    torch._dynamo.reset()
    q, k, v = (z.requires_grad_() for z in _heads(b=batch, t=t))
    got = torch.compile(_attend, backend="kiln")(q, k, v)
    want = _attend(q, k, v)
    assert got.shape == want.shape == (batch, t, 12)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


def test_whole_step_with_the_default_optimizer_equals_eager():
    """Forward, backward and AdamW's step (its default foreach path) in one compiled function."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(_Block(32, 4, 16), _Block(32, 4, 16))
    eager_model = copy.deepcopy(model)
    replay_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 16, 32, generator=g) for _ in range(3)]

    def step(model, opt, x):
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        return loss

    before = metrics.counters().get("strided_matmuls", 0)
    cstep = torch.compile(step, backend="kiln")
    runs = []
    for mdl, fn in ((model, cstep), (eager_model, step)):
        opt = torch.optim.AdamW(mdl.parameters(), lr=1e-2)
        losses, grads = [], []
        for x in xs:
            losses.append(fn(mdl, opt, x).detach())
            grads.append([p.grad.detach().clone() for p in mdl.parameters()])
            opt.zero_grad()
        runs.append((torch.stack(losses), grads, [p.detach().clone() for p in mdl.parameters()]))
    assert metrics.counters().get("strided_matmuls", 0) - before == 4
    got, want = runs
    assert_same_training(got, (want[0], want[1], _replayed(replay_model, got[1])))


@pytest.mark.parametrize(
    "t,counter",
    [(5, "strided_matmuls"), (256, "attention_to_sdpa")],
    ids=["strided_matmul", "attention_rewrite"],
)
def test_a_users_saved_tensor_hooks_see_no_fake_tensors(t, counter):
    """The Dynamo rewrites compute their new nodes' example values on fake tensors with autograd
    on; a user's ``saved_tensors_hooks`` (here a memory probe reading storages, which raises on a
    fake tensor) must neither be called with them nor stop the rewrite (long keys: the
    hand-written attention becomes SDPA, kiln/frontends/compile/attention.py)."""
    from torch._subclasses.fake_tensor import FakeTensor

    torch._dynamo.reset()
    seen = []

    def pack(x):
        seen.append(isinstance(x, FakeTensor))
        x.untyped_storage().nbytes()
        return x

    q, k, v = (z.requires_grad_() for z in _heads(t=t))
    before = metrics.counters().get(counter, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = torch.compile(_attend, backend="kiln")(q, k, v)
    out.sum().backward()
    assert metrics.counters().get(counter, 0) > before
    assert seen and not any(seen)
    torch.testing.assert_close(out, _attend(q, k, v), rtol=1e-5, atol=1e-6)
