"""``torch.compile(step, backend="kiln")`` over a model on the kiln device.

AOTAutograd's fake tensors cannot take kiln tensors: the compile failed with ``AssertionError:
Please convert all Tensors to FakeTensors first`` (Inductor and aot_eager fail too).  Kiln's
backend now leaves such graphs to the device, which records them and compiles at ``mark_step``,
as torch.compile's XLA backend does for XLA tensors.  Under Dynamo, AdamW's foreach path passes its
step sizes as a CPU tensor (``_foreach_addcdiv_.Tensor``'s ``scalars``, which every device reads
on the host); the Python recorder had refused it as a tensor of another device."""

from __future__ import annotations

import copy
import warnings

import torch
from _training_compare import assert_same_training
from torch import nn

import kiln

DEV = kiln.device()


def _train(model: nn.Module, xs: list[torch.Tensor], device: torch.device, compiled: bool):
    m = copy.deepcopy(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    grads = []

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = m(x).pow(2).mean()
        loss.backward()
        grads.append([p.grad.detach().clone() for p in m.parameters()])
        opt.step()
        opt.zero_grad()
        return loss

    f = torch.compile(step, backend="kiln") if compiled else step
    losses = []
    for x in xs:
        loss = f(x.to(device))
        if device == DEV:
            kiln.mark_step()
        losses.append(loss.item())
    return (
        torch.tensor(losses),
        [[g.cpu() for g in s] for s in grads],
        [p.detach().cpu() for p in m.parameters()],
    )


def test_compiled_step_of_a_model_on_the_device_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 8, generator=g) for _ in range(4)]
    torch._dynamo.reset()
    before = kiln.metrics.get("lazy_device_graphs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's graph-break notes about the optimizer
        got = _train(model, xs, DEV, compiled=True)
    if kiln.config.lazy_recorder == "native":
        # (Dynamo cannot trace the Python recorder's tensor subclass: it runs the step eagerly)
        assert kiln.metrics.get("lazy_device_graphs") > before
    assert_same_training(got, _train(model, xs, torch.device("cpu"), compiled=False))


def test_foreach_scalars_tensor_stays_on_the_host():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    t1 = [torch.randn_like(x) for x in xs]
    t2 = [torch.rand_like(x) + 0.5 for x in xs]
    scalars = torch.tensor([-0.1, 0.25])  # a CPU tensor, as for CUDA tensors
    want = [x.clone() for x in xs]
    torch._foreach_addcdiv_(want, t1, t2, scalars)
    got = [x.to(DEV) for x in xs]
    torch._foreach_addcdiv_(got, [t.to(DEV) for t in t1], [t.to(DEV) for t in t2], scalars)
    outs = torch._foreach_addcmul(
        [x.to(DEV) for x in xs], [t.to(DEV) for t in t1], [t.to(DEV) for t in t2], scalars
    )
    kiln.mark_step()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b)
    for a, x, u, v, s in zip(outs, xs, t1, t2, scalars.tolist(), strict=True):
        torch.testing.assert_close(a.cpu(), x + s * u * v)
