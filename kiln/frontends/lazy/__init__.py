"""Lazy device frontend (the PyTorch/XLA programming model): ``kiln.device()``, ``kiln.mark_step()``."""

import torch._dynamo.trace_rules

from kiln.frontends.lazy.device import device, mark_step, optimizer_step, sync

# The recorder's Python is the device's machinery, never user code for torch.compile to trace: a
# compiled step over kiln tensors reaches it from ``__torch_dispatch__`` (the Python recorder)
# and Dynamo compiled its functions as frames of their own (tens of graphs, each run through a
# backend).  Skipped as Dynamo skips torch's own files.
torch._dynamo.trace_rules.add(__name__)

__all__ = ["device", "mark_step", "optimizer_step", "sync"]
