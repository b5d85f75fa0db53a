"""Kiln's device-backend autoload hook (entry point group ``torch.backends``).

``import torch`` calls :func:`load` as its last step, in every process of an environment where
Kiln is installed.  It does the one thing that cannot wait for ``import kiln``: it registers a
device guard for PyTorch's PrivateUse1 slot, because the autograd engine sizes its per-device
queues once, at the first backward pass of the process, from the guards registered then.  With the
guard in place, ``import kiln`` may come after any amount of eager training.

Nothing else happens here: the slot is not renamed, no device module, hooks or kernels are
registered, so ``torch.accelerator.current_accelerator()`` and every eager code path stay as they
are until the program imports kiln.  This module imports nothing but torch (already loaded) and
never raises: a failure becomes a warning, and ``import kiln`` later reports what it means.

Switch off with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (PyTorch's own switch); then import kiln
before the first backward pass of the process.
"""

from __future__ import annotations

import warnings

_guard: object | None = None  # the registered guard; kept alive for the life of the process
_error: str | None = None  # why registration failed, for kiln's error message


def load() -> None:
    """Register a PrivateUse1 device guard (deviceCount 1) before any backward can run."""
    global _guard, _error
    if _guard is not None:
        return
    try:
        import torch

        class _KilnDeviceGuard(torch._C._acc.DeviceGuard):
            def type_(self):
                return torch._C._autograd.DeviceType.PrivateUse1

        guard = _KilnDeviceGuard()
        torch._C._acc.register_python_privateuseone_device_guard(guard)
        _guard = guard
    except Exception as e:  # noqa: BLE001 - an exception here would abort ``import torch``
        _error = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"kiln: could not register the kiln device guard at torch import ({_error}); "
            "the kiln device will only work if kiln is imported before the first backward pass",
            RuntimeWarning,
            stacklevel=2,
        )


def guard() -> object | None:
    """The guard registered by :func:`load`, or None when autoload did not run or failed."""
    return _guard
