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
from kiln.frontends.lazy.device import AcceleratorConflictWarning
from kiln.frontends.lazy.device import register_at_import as _register_device

# Registers the kiln device (PrivateUse1 renamed, device guard, hooks, kernels).  Import order
# does not matter: a process that ran backward passes before ``import kiln`` runs its backward
# passes on the calling thread from the device's first use on (kiln/frontends/lazy/device.py).
# Conversions to and from kiln swap parameters in place (tied weights stay tied) without changing
# PyTorch's process-wide setting: see kiln/frontends/lazy/conversion.py.  On a machine with a GPU
# the device is registered at the first kiln.device() instead: naming the slot would break cuda
# backward passes (see register_at_import).
_register_device()

from kiln.observe.hook import install as _install_observe
from kiln.observe.tensorboard import tensorboard

# Step hook: the state record for kiln ls / kiln top, TensorBoard, KILN_PROFILE (kiln.observe).
_install_observe()

__all__ = [
    "AcceleratorConflictWarning",
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
    "tensorboard",
]
