"""Lazy device frontend (the PyTorch/XLA programming model): ``kiln.device()``, ``kiln.mark_step()``."""

from kiln.frontends.lazy.device import device, mark_step, optimizer_step, sync

__all__ = ["device", "mark_step", "optimizer_step", "sync"]
