"""The teacher-student MLP study behind the precision numbers (shared by bench and tests).

A fixed random teacher MLP (64-256-256-64, GELU) labels fresh Gaussian batches; a student of the
same shape learns it with MSE and stock ``torch.optim.AdamW`` (lr 1e-4).  ``train(mode, ...)``
returns the per-step losses.  Modes:

  fp32              eager PyTorch, float32 (the reference)
  bf16-rne/bf16-sr  pure bf16 (``model.to(torch.bfloat16)``) through ``torch.compile(backend=
                    "kiln")``, with ``kiln.config.stochastic_rounding`` off / on
  lazy-bf16-rne/sr  the same on the Kiln lazy device
  eager-bf16        pure bf16 eager PyTorch (round to nearest)
  autocast          fp32 weights, ``torch.autocast("cpu", bfloat16)`` forward, eager
  fp8               fp32 weights, every Linear an :class:`~kiln.precision.Fp8Linear` (rowwise)
"""

from __future__ import annotations

import torch
from torch import nn

import kiln
from kiln.precision import convert_to_fp8, manual_seed

MODES = (
    "fp32",
    "bf16-rne",
    "bf16-sr",
    "lazy-bf16-rne",
    "lazy-bf16-sr",
    "eager-bf16",
    "autocast",
    "fp8",
)


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64)
    )


def batches(seed: int, steps: int, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = mlp(10_000 + seed)
    g = torch.Generator().manual_seed(20_000 + seed)
    xs = torch.randn(steps, batch, 64, generator=g)
    with torch.no_grad():
        ys = teacher(xs)
    return xs, ys


def train(mode: str, seed: int, steps: int, lr: float = 1e-4) -> list[float]:
    """Per-step losses (float) of one run."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    xs, ys = batches(seed, steps)
    model = mlp(seed)
    bf16 = "bf16" in mode
    lazy = mode.startswith("lazy")
    sr = mode.endswith("-sr")
    dev = kiln.device() if lazy else torch.device("cpu")
    if bf16:
        model = model.to(torch.bfloat16)
        xs, ys = xs.bfloat16(), ys.bfloat16()
    if mode == "fp8":
        convert_to_fp8(model, "rowwise")
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    old_sr = kiln.config.stochastic_rounding
    kiln.config.update(stochastic_rounding=sr)
    manual_seed(seed)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
        else:
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    losses: list[torch.Tensor] = []
    try:
        if mode in ("bf16-rne", "bf16-sr"):
            torch._dynamo.reset()
            run = torch.compile(step, backend="kiln")
        else:
            run = step
        for i in range(steps):
            loss = run(xs[i].to(dev), ys[i].to(dev))
            if lazy:
                kiln.mark_step()
            losses.append(loss)
        out = [float(v) for v in torch.stack([v.cpu() for v in losses]).float()]
    finally:
        kiln.config.update(stochastic_rounding=old_sr)
    return out


def final_loss(losses: list[float], last: int = 50) -> float:
    tail = losses[-last:]
    return sum(tail) / len(tail)
