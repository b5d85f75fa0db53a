"""Optimizer configurations and a training step shared by the compile and lazy parity tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

# (id, params -> optimizer): the update rules torch.optim offers, with their less common options
OPTIMIZERS: list[tuple[str, Callable]] = [
    (
        "sgd-nesterov",
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    ),
    ("adam-amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)),
    ("rmsprop-centered", lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True)),
    ("adagrad", lambda ps: torch.optim.Adagrad(ps, lr=1e-2)),
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    ("adamw-loop", lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
]


def mse_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable:
    """``step(x, y) -> loss``: forward, MSE loss, backward, optimizer step, zero_grad."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def loss_and_grads_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable:
    """``step(x, y) -> (loss, {name: gradient})`` for a model that returns its loss: forward,
    backward, the gradients copied, optimizer step, zero_grad."""

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = model(x, y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        return loss.detach(), grads

    return step


def check_compiled_step_matches_eager(
    make_opt: Callable, compile_fn: Callable, steps: int = 4
) -> None:
    """A small model trained ``steps`` steps by ``mse_step`` in eager and through ``compile_fn``
    (e.g. ``kiln.compile``) from the same weights and batches: losses, parameters and every
    tensor of the optimizer state equal eager's."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))
    twin = copy.deepcopy(model)
    opts = [make_opt(model.parameters()), make_opt(twin.parameters())]
    eager, compiled = mse_step(model, opts[0]), compile_fn(mse_step(twin, opts[1]))
    for _ in range(steps):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        torch.testing.assert_close(compiled(x, y), eager(x, y))
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(b, a)
    for sa, sb in zip(opts[0].state.values(), opts[1].state.values()):
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                torch.testing.assert_close(sb[k], sa[k], msg=f"optimizer state {k}")
