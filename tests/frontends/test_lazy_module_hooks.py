"""What parameters keep through ``model.to(kiln)``, and the device's first use inside it.

Moving a module to the kiln device swaps each parameter in place (``torch.utils.swap_tensors``,
see ``lazy/conversion.py``), which left its gradient hooks on the old TensorImpl -- a hook
registered before the move never ran: a hook that halves a gradient left it whole, silently --
and dropped its attributes and ``Parameter`` subclass, which eager's ``param.data =`` keeps on a
CPU -> CUDA move.  Here hooks registered before the move run on the device as in eager (gradients
and parameters after an SGD step compared), post-accumulate hooks run, a removed hook stays
removed, hooks survive the move back to the CPU, attributes and subclasses stay; and
``model.to("kiln")`` as a process's first use of the device works (its engine probe ran under
Module._apply's no_grad and raised)."""

from __future__ import annotations

import copy

import torch
from _subprocess import run_json
from torch import nn

import kiln

DEV = kiln.device()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _hooked(m: nn.Module, calls: list) -> list:
    handles = [
        m[0].weight.register_hook(lambda g: g * 0.5),
        m[2].bias.register_hook(lambda g: g.clamp(-0.1, 0.1)),
        m[2].weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.shape)),
    ]
    return handles


def _step(m: nn.Module, x: torch.Tensor, dev: torch.device) -> list[torch.Tensor]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x.to(dev)).pow(2).sum().backward()
    grads = [p.grad.detach().cpu().clone() for p in m.parameters()]
    opt.step()
    if dev == DEV:
        kiln.mark_step()
    return grads + [p.detach().cpu().clone() for p in m.parameters()]


def test_hooks_registered_before_moving_to_the_device_run_there():
    x = torch.randn(3, 4)
    want_calls: list = []
    eager = _model()
    _hooked(eager, want_calls)
    want = _step(eager, x, torch.device("cpu"))

    got_calls: list = []
    lazy = _model()
    _hooked(lazy, got_calls)
    lazy.to(DEV)
    got = _step(lazy, x, DEV)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert got_calls == want_calls == [torch.Size([2, 8])]


def test_a_removed_hook_stays_removed_after_the_move():
    x = torch.randn(3, 4)
    base = _model()
    want = _step(copy.deepcopy(base), x, torch.device("cpu"))  # no hooks
    m = copy.deepcopy(base)
    handles = _hooked(m, [])
    m.to(DEV)
    for h in handles:
        h.remove()
    got = _step(m, x, DEV)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_hooks_survive_the_move_back_to_the_cpu():
    x = torch.randn(3, 4)
    want = _step(_hooked_model(), x, torch.device("cpu"))
    m = _hooked_model()
    m.to(DEV)
    m.cpu()
    got = _step(m, x, torch.device("cpu"))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _hooked_model() -> nn.Module:
    m = _model()
    _hooked(m, [])
    return m


class _Tagged(nn.Parameter):
    """A user's Parameter subclass."""


def test_attributes_and_parameter_subclasses_survive_the_move():
    m = nn.Linear(3, 2)
    m.weight.no_decay = True
    m.bias = _Tagged(m.bias.detach().clone())
    m.bias.tag = "bias"
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.to(DEV)
    assert m.weight.no_decay is True and m.bias.tag == "bias"
    assert isinstance(m.bias, nn.Parameter)
    if type(m.bias) is not kiln.frontends.lazy.tensor.LazyTensor:  # the native recorder's
        assert type(m.bias) is _Tagged
    assert opt.param_groups[0]["params"][0] is m.weight  # still the optimizer's parameter
    m.cpu()
    assert m.weight.no_decay is True and m.bias.tag == "bias"
    assert not hasattr(m.weight, "_st")  # no kiln state left on the CPU parameter


def test_module_to_kiln_as_the_first_use_of_the_device():
    code = """
import json, torch, kiln
from torch import nn
m = nn.Linear(3, 2).to("kiln")  # no kiln.device() before
loss = m(torch.ones(4, 3).to("kiln")).sum()
loss.backward()
kiln.mark_step()
print(json.dumps({"device": str(m.weight.device), "grad": m.weight.grad.cpu().tolist()}))
"""
    out = run_json(code)
    assert out["device"] == "kiln:0"
    assert out["grad"] == [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]


def test_dtype_conversion_on_the_device_while_a_graph_holds_the_parameters():
    # kiln -> kiln conversions assign .data as eager does; a swap raised while an autograd graph
    # (here: the kept forward output) still referenced the parameters
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    m = copy.deepcopy(base)
    m[0].weight.no_decay = True  # (deepcopy does not copy a parameter's attributes)
    m.to(DEV)
    weight = m[0].weight
    out = m(torch.randn(3, 4).to(DEV))  # holds the parameters' AccumulateGrad nodes
    m.to(torch.float64)
    assert m[0].weight is weight and weight.dtype == torch.float64 and weight.no_decay is True
    x = torch.randn(3, 4, dtype=torch.float64)
    want = copy.deepcopy(base).double()(x)
    got = m(x.to(DEV))
    kiln.mark_step()
    torch.testing.assert_close(got.cpu(), want)
    del out
