"""Kiln: an open training compiler and lazy accelerator runtime for PyTorch.

Two programming models over one graph IR:

    # 1. torch.compile backend
    step = torch.compile(step, backend="kiln")        # or kiln.compile(step)

    # 2. lazy device (the PyTorch/XLA model)
    dev = kiln.device()
    model.to(dev)
    loss = model(x.to(dev)).sum(); loss.backward(); opt.step()
    kiln.mark_step()                                  # compile (cached) + run the whole step
"""

from __future__ import annotations

__version__ = "0.1.0"

import torch

from kiln import metrics
from kiln.config import Config, ConfigError, config
from kiln.frontends.compile.backend import _register as _register_backend
from kiln.frontends.compile.backend import compile

_register_backend()

from kiln.frontends.lazy import device, mark_step, optimizer_step, sync
from kiln.frontends.lazy.device import _register as _register_device

# Registered at import: PyTorch's autograd engine sizes its per-device queues on the first
# backward pass, so the kiln device must exist before any backward runs in the process.
_register_device()
# Module.to(kiln.device()) swaps each parameter in place (torch.utils.swap_tensors) instead of
# making new Parameter objects: shared (tied) weights stay one tensor, and references held before
# the move stay valid.  This is PyTorch's own switch, planned to become its default.
torch.__future__.set_swap_module_params_on_conversion(True)

__all__ = [
    "Config",
    "ConfigError",
    "__version__",
    "compile",
    "config",
    "metrics",
    "device",
    "mark_step",
    "optimizer_step",
    "sync",
]
