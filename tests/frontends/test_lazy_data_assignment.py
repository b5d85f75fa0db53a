"""``param.data = t`` on the kiln device (weight initialisation, ``vector_to_parameters``, EMA
copies).  The native recorder raised ``NotImplementedError: shallow_copy_from``; the Python
recorder changed the parameter's metadata but kept its old value, silently.  Here values, shapes,
the parameter's identity (an optimizer holding it sees the new value) and training afterwards,
against the same code in eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kiln

DEV = kiln.device()


def _run(m: nn.Module, dev: torch.device) -> list[torch.Tensor]:
    m = m.to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # holds the Parameter objects
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m[0].weight.data = m[0].weight.data * 2  # a new value under the same parameter
        m[0].bias.data = torch.zeros(8).to(dev)
    vec = nn.utils.parameters_to_vector(m.parameters())
    nn.utils.vector_to_parameters(vec + 0.01, m.parameters())
    for _ in range(2):
        loss = m(torch.randn(4, 6, generator=g).to(dev)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dev == DEV:
            kiln.mark_step()
    return [p.detach().cpu() for p in m.parameters()]


def test_data_assignment_then_training_matches_eager():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    want = _run(copy.deepcopy(base), torch.device("cpu"))
    got = _run(copy.deepcopy(base), DEV)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_data_assignment_keeps_identity_and_takes_shape_and_values():
    p = nn.Parameter(torch.randn(2, 3).to(DEV))
    pid = id(p)
    version = p._version
    p.data = torch.arange(12.0).reshape(4, 3).to(DEV)
    assert id(p) == pid and isinstance(p, nn.Parameter) and p.requires_grad
    assert p.shape == (4, 3) and p._version == version
    assert torch.equal(p.detach().cpu(), torch.arange(12.0).reshape(4, 3))
    p.data = p.data.t()  # a view's geometry comes along
    assert p.shape == (3, 4)
    assert torch.equal(p.detach().cpu(), torch.arange(12.0).reshape(4, 3).t())


def test_data_assignment_of_a_cpu_tensor_raises():
    p = nn.Parameter(torch.randn(2, 3).to(DEV))
    with pytest.raises(RuntimeError):
        p.data = torch.zeros(2, 3)
    assert p.device.type == "kiln" and p.shape == (2, 3)
