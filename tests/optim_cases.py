"""Optimizer configurations and a training step shared by the compile and lazy parity tests."""

from __future__ import annotations

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
