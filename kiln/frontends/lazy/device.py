"""The ``kiln`` device: registration with PyTorch and the user-facing API.

    dev = kiln.device()              # torch.device("kiln", 0)
    model.to(dev); x = x.to(dev)
    loss = model(x).sum(); loss.backward(); opt.step()
    kiln.mark_step()                 # or kiln.optimizer_step(opt)

PyTorch's PrivateUse1 backend slot is renamed to ``kiln``; factory functions with
``device=dev`` reach :func:`kiln.frontends.lazy.tensor.factory` through a dispatch fallback, and every
other op reaches ``LazyTensor.__torch_dispatch__``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_registered = False
_reg_lock = threading.Lock()


class _KilnModule:
    """``torch.kiln``: what PyTorch expects of a device module."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Lazy random ops draw their per-step seed from torch's CPU generator."""

    @staticmethod
    def manual_seed(seed: int) -> None:
        """See manual_seed_all."""

    # Not traced by Dynamo (code that saves/restores the accelerator's RNG around a compiled op,
    # e.g. torch.testing's freeze_rng_state, runs these under no_dispatch): a graph break instead.
    @staticmethod
    @torch.compiler.disable
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    @torch.compiler.disable
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        from kiln.frontends.lazy.trace import sync

        sync()


_COMPOSITE_FACTORIES = [
    "arange",
    "arange.start",
    "arange.start_step",
    "full",
    "zeros",
    "ones",
    "rand",
    "randn",
    "randint",
    "randint.low",
    "linspace",
    "eye",
    "eye.m",
    "scalar_tensor",
    "randperm",
]


def _factory_kernel(op: Any) -> Any:
    from kiln.frontends.lazy.tensor import factory

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return factory(op, *args, **kwargs)

    return kernel


def _copy_kernel(dst: Any, src: Any, non_blocking: bool = False) -> Any:
    from kiln.frontends.lazy.tensor import dispatch

    return dispatch(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})


def _register() -> None:
    global _registered
    with _reg_lock:
        if _registered:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() not in ("privateuseone", "kiln"):
            raise RuntimeError(
                "Kiln's lazy device needs PyTorch's PrivateUse1 backend slot, but another backend "
                f"({torch._C._get_privateuse1_backend_name()!r}) already took it in this process"
            )
        if torch._C._get_privateuse1_backend_name() == "privateuseone":
            _setup_privateuseone_for_python_backend("kiln", backend_module=_KilnModule())
        from kiln.frontends.lazy.tensor import factory

        lib = torch.library.Library("_", "IMPL")
        lib.fallback(
            lambda keyset, op, *args, **kwargs: factory(op, *args, **kwargs),
            dispatch_key="PrivateUse1",
            with_keyset=True,
        )
        # Composite factories (arange = empty + arange.out, ...) would otherwise resize a tensor
        # in place; give them a kiln kernel so they are recorded as one node.
        impl = torch.library.Library("aten", "IMPL")
        for name in _COMPOSITE_FACTORIES:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            impl.impl(name, _factory_kernel(op), "PrivateUse1")
        # torch.tensor(data, device=kiln) copies into the new tensor with the Python dispatch key
        # excluded: copy_ then needs a kiln kernel of its own (the fallback cannot serve it).
        impl.impl("copy_", _copy_kernel, "PrivateUse1")
        _register.lib = (lib, impl)  # type: ignore[attr-defined]  # keep registrations alive
        _allow_foreach()
        _registered = True


def _allow_foreach() -> None:
    """Let torch.optim (and grad clipping) take their multi-tensor ``_foreach_*`` path for lazy
    tensors, as PyTorch does for its own tensor subclass DTensor: they check ``type(p)`` against
    these lists, and "kiln" is already a foreach device.  One foreach call records a whole
    parameter list; the per-parameter loop dispatched ~12 ops per parameter (tiny-GPT AdamW step:
    700 dispatches, 124 -> 80 ms per lazy step)."""
    import torch.optim.optimizer as optim_mod
    import torch.utils._foreach_utils as foreach_utils

    from kiln.frontends.lazy.tensor import LazyTensor

    for lst in (
        getattr(optim_mod, "_foreach_supported_types", None),
        getattr(foreach_utils, "_foreach_supported_types", None),
    ):
        if isinstance(lst, list) and LazyTensor not in lst:
            lst.append(LazyTensor)


def device(index: int = 0) -> torch.device:
    """The Kiln lazy device, as a ``torch.device`` to pass to ``.to()`` and factory functions."""
    if index != 0:
        raise ValueError(f"Kiln has one lazy device (index 0); got index {index}")
    _register()
    return torch.device("kiln", 0)


def mark_step() -> None:
    """Cut the pending graph: compile it (cached by structural hash), run it, materialize."""
    from kiln.frontends.lazy.trace import sync

    sync()


def sync() -> None:
    """Same as :func:`mark_step`."""
    mark_step()


def optimizer_step(optimizer: torch.optim.Optimizer, **step_kwargs: Any) -> Any:
    """``optimizer.step()`` followed by :func:`mark_step`, as in PyTorch/XLA."""
    loss = optimizer.step(**step_kwargs)
    mark_step()
    return loss
