"""A module that mutates a buffer in its forward and computes with the new value.

The min-cut partitioner recomputed ``1 + 1 / n`` in the backward from the buffer ``n`` -- after
the forward had written ``n + 1`` into it -- so a module counting its calls (``self.n.add_(1)``)
and scaling by ``1 / n`` got every gradient scaled by the next call's factor (1.5 where eager has
2), silently; Inductor and aot_eager too (torch 2.13).  Kiln's partition never recomputes a read
of a mutated input (``kiln/frontends/compile/partition.py``).  Here outputs, gradients, buffers and
trained parameters against eager, and that batch norm's partition is unchanged by the rule."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kiln
from kiln.config import config
from kiln.frontends.compile import partition


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("n", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return y * (1 + 1 / self.n) + x[:, :4] * self.n


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


def test_gradients_use_the_value_the_forward_computed():
    torch.manual_seed(0)
    eager = Counter()
    twin = copy.deepcopy(eager)
    compiled = kiln.compile(twin)
    for x in _batches():
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = eager(xe), compiled(xc)
        torch.testing.assert_close(got, want)
        want.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad)
        for a, b in zip(twin.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad)
            a.grad = b.grad = None
        torch.testing.assert_close(twin.n, eager.n)
        torch.testing.assert_close(twin.ema, eager.ema)


def test_training_step_matches_eager():
    def train(compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = Counter()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        f = kiln.compile(step) if compiled else step
        losses = torch.stack([f(x).detach() for x in _batches()])
        return [losses, m.n, m.ema, *(p.detach() for p in m.parameters())]

    for a, b in zip(train(True), train(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batch_norm_partition_is_unchanged(monkeypatch):
    # running statistics are mutated buffers the backward never reads: the rule marks their
    # readers, and the forward saves exactly what the plain min-cut partition saves
    saved: dict[str, int] = {}
    real = partition.min_cut_rematerialization_partition

    def counting(joint, joint_inputs, **kw):
        fw, bw = real(joint, joint_inputs, **kw)
        saved[mode] = len(bw.graph.find_nodes(op="placeholder"))
        return fw, bw

    monkeypatch.setattr(partition, "min_cut_rematerialization_partition", counting)
    monkeypatch.setattr(config, "disk_cache", False)  # both modes partition afresh
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    x = _batches(1)[0]
    marked = []
    keep = partition.keep_reads_of_mutated_inputs
    for mode in ("plain", "kiln"):
        torch._dynamo.reset()
        if mode == "plain":
            monkeypatch.setattr(partition, "keep_reads_of_mutated_inputs", lambda g: 0)
        else:
            monkeypatch.setattr(
                partition, "keep_reads_of_mutated_inputs", lambda g: marked.append(keep(g))
            )
        kiln.compile(copy.deepcopy(model))(x).sum().backward()
    assert marked and marked[0] > 0  # the running statistics' readers were marked
    assert saved["kiln"] == saved["plain"]
