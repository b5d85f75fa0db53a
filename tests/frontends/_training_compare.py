"""Comparing a short training run on the kiln device (or compiled) against eager's."""

from __future__ import annotations

import torch

# (losses, gradients of each step, parameters after the run)
Run = tuple[torch.Tensor, list[list[torch.Tensor]], list[torch.Tensor]]


def assert_same_training(got: Run, want: Run, rtol: float = 1e-5) -> None:
    """Losses and final parameters within ``rtol``, every step's gradients within ``10 * rtol``
    (a gradient is a sum over the batch: its rounding differs more)."""
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=1e-6)
    for step_got, step_want in zip(got[1], want[1], strict=True):
        for a, b in zip(step_got, step_want, strict=True):
            torch.testing.assert_close(a, b, rtol=10 * rtol, atol=1e-5)
    for a, b in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6)
