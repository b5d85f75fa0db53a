"""Kiln backward passes on the calling thread, in a process whose autograd engine started first.

PyTorch's autograd engine sizes its per-device worker queues once, at the process's first
backward pass, from the device guards registered at that moment, and runs a kiln tensor's
backward nodes on the kiln queue's worker thread.  When a backward pass ran before ``import
kiln`` registered the kiln guard, the engine has no kiln queue (an internal assert on
``device_ready_queues_``); it can still run every node on the calling thread, which is what
``torch.autograd.set_multithreading_enabled(False)`` asks for.

:func:`install` makes every backward pass of the process run that way: ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` all reach the engine through
``torch.autograd._engine_run_backward``, which it wraps.  Kiln installs it only in that case
(the device check at the first use of the device finds it); a process that imports kiln before
its first backward keeps PyTorch's device threads.  Registering the guard earlier, at ``import
torch`` through PyTorch's device-backend autoload, also avoids the assert, but then every process
of an environment with kiln installed starts a device thread at its first backward, and PyTorch
then refuses autograd in forked children: kiln would change programs that never use it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd

_installed = False
_translating = False

# PyTorch's autograd engine asserts on the streams of a device guard that has none (the kiln
# device's Python guard) when a gradient crosses from another device to a kiln tensor
_STREAM_ASSERT = "opt_ready_stream && opt_parent_stream"
# C++ code that pins host memory for the current accelerator asks its hooks for an allocator;
# the kiln device's hooks are Python ones (PyTorch registers hooks once per process, and kiln's
# must answer from ``import kiln`` on), which cannot provide it.  DistributedDataParallel's
# reducer does so in backward with ``find_unused_parameters=True``.
_PINNED = "getPinnedMemoryAllocator"


def install() -> None:
    """Run every later backward pass of this process on its calling thread (idempotent)."""
    global _installed
    if _installed:
        return
    original = getattr(torch.autograd, "_engine_run_backward", None)
    if original is None:
        raise RuntimeError(
            "kiln: this PyTorch has no torch.autograd._engine_run_backward, so kiln cannot run "
            "backward passes in a process whose autograd engine started before kiln was imported; "
            "import kiln before the first backward pass"
        )

    def run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.set_multithreading_enabled(False):
            return original(t_outputs, *args, **kwargs)

    torch.autograd._engine_run_backward = run_backward
    _installed = True


def installed() -> bool:
    return _installed


def translate_engine_errors() -> None:
    """Make a backward pass through a copy from the kiln device to another device that also
    changes the dtype (``.to("cpu", torch.float64)``; a plain ``.cpu()`` works) raise an error
    that names the problem and the fix, instead of the autograd engine's internal
    assert on device streams; likewise a backward pass that needs pinned memory for the kiln
    device (``_PINNED``) (idempotent; every other error passes through unchanged)."""
    global _translating
    original = getattr(torch.autograd, "_engine_run_backward", None)
    if _translating or original is None:
        return

    def run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(t_outputs, *args, **kwargs)
        except NotImplementedError as e:
            if _PINNED not in str(e):
                raise
            raise RuntimeError(
                "kiln: this backward pass needs pinned host memory for the kiln device, which "
                "PyTorch's C++ code asks of the device's hooks and kiln cannot provide there. "
                "DistributedDataParallel(find_unused_parameters=True) on a kiln-device model "
                "does this: use kiln.distributed.GradientSync(model) instead (it handles "
                "parameters without a gradient as DDP does), or find_unused_parameters=False "
                "where every parameter gets a gradient"
            ) from e
        except RuntimeError as e:
            if _STREAM_ASSERT not in str(e):
                raise
            raise RuntimeError(
                "kiln: backward through a copy from the kiln device to another device that also "
                "changes the dtype (e.g. .to('cpu', torch.float64)) is not supported: PyTorch's "
                "autograd engine needs device streams to send that gradient back to the kiln "
                "device, which has none. Change the dtype on the kiln device first "
                "(x.double().cpu()), or compute the loss on the kiln device"
            ) from e

    torch.autograd._engine_run_backward = run_backward
    _translating = True
