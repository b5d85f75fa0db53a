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
import warnings
from typing import Any

import torch

from kiln.config import config
from kiln.frontends.lazy import backward_thread, device_guard, device_module
from kiln.frontends.lazy.device_module import KILN_MODULE

_registered = False
_reg_lock = threading.Lock()


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


# The allocations behind ``batch.to(kiln)`` (the first ops of every step): under the native
# recorder, the same call records the same input-free node, so it is replayed without the
# factory's Python path (~10 us a call, ~90 us with the caches cold after a step's kernels).
_REPLAYED = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)
_replay: dict[tuple, Any] = {}
_REPLAY_MAX = 256


def _replay_key(op: Any, args: tuple, kwargs: dict) -> tuple | None:
    try:
        key = (op, torch.get_default_dtype(), *map(_frozen, args), *sorted(kwargs.items()))
        hash(key)
    except TypeError:  # (an argument with no stable value: no replay)
        return None
    return key


def _frozen(a: Any) -> Any:
    return tuple(a) if isinstance(a, list) else a


def _factory(op: Any, args: tuple, kwargs: dict) -> Any:
    """A factory with ``device=kiln``: a tensor of the recorder ``config.lazy_recorder`` names
    (asked per call, so both recorders can serve one process; the engine probe always uses the
    Python recorder's throw-away trace, and the eager debug mode, ``config.eager``, the Python
    recorder, which implements it).  Where the native recorder cannot be built or loaded, the
    Python recorder serves the call (``native.device.usable``: one warning, counted)."""
    if config.lazy_recorder == "native" and not _probing and not config.eager:
        key = _replay_key(op, args, kwargs) if op in _REPLAYED else None
        replay = _replay.get(key) if key is not None else None
        if replay is not None and device_module.unusable is None:
            return replay()
        from kiln.frontends.lazy.native import device as native_device

        if native_device.usable():
            out = _native_factory(native_device, op, args, kwargs)
            if key is not None:
                from kiln.frontends.lazy import native

                if len(_replay) >= _REPLAY_MAX:
                    _replay.clear()
                _replay[key] = native.factory_replayer(op, args, kwargs)
            return out
    from kiln.frontends.lazy.tensor import factory

    return factory(op, *args, **kwargs)


def _native_factory(native_device: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    from kiln.frontends.lazy import device_module as devmod

    if devmod.unusable is not None or devmod.pending_probe is not None:
        devmod.check_usable()
    if kwargs.get("device") is not None:  # (never replayed before this check passed once)
        devmod._index(kwargs["device"])  # "kiln:1": an error naming the one device
    return native_device.factory(op, args, kwargs)


def _factory_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _factory(op, args, kwargs)

    return kernel


def _copy_kernel(dst: Any, src: Any, non_blocking: bool = False) -> Any:
    from kiln.frontends.lazy.tensor import dispatch

    return dispatch(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})


def _register() -> None:
    """Make the ``kiln`` device usable in this process (called by ``import kiln``).

    Renames PyTorch's PrivateUse1 slot to ``kiln`` and registers the device module
    (``torch.kiln``), the accelerator hooks, the device guard, the kernels that create kiln
    tensors, the kiln autocast kernels, and the scoped conversion rules.  The first use of the
    device (:func:`device`, a kiln factory) then checks that PyTorch's autograd engine can serve
    it (:func:`_engine_check`: a backward pass ran before this registration leaves the engine
    without a kiln queue); the check is a backward pass, so it does not run at import: after one,
    PyTorch refuses autograd in forked children.
    """
    global _registered
    with _reg_lock:
        if _registered:
            return
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", "kiln"):
            raise RuntimeError(
                "Kiln's lazy device needs PyTorch's PrivateUse1 backend slot, but another backend "
                f"({name!r}) already took it in this process"
            )
        if name == "privateuseone":
            torch.utils.rename_privateuse1_backend("kiln")
            torch.utils.generate_methods_for_privateuse1_backend()
            torch._register_device_module("kiln", KILN_MODULE)
            torch._C._acc.register_python_privateuseone_hook(_Hooks())
            torch._C._acc.register_python_privateuseone_device_guard(_GUARD)
        from kiln.frontends.lazy import autocast, conversion, serialization

        lib = torch.library.Library("_", "IMPL")
        lib.fallback(
            lambda keyset, op, *args, **kwargs: _factory(op, args, kwargs),
            dispatch_key="PrivateUse1",
            with_keyset=True,
        )
        # Composite factories (arange = empty + arange.out, ...) would otherwise resize a tensor
        # in place; give them a kiln kernel so they are recorded as one node.
        impl = torch.library.Library("aten", "IMPL")
        for op_name in _COMPOSITE_FACTORIES:
            packet, _, overload = op_name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            impl.impl(op_name, _factory_kernel(op), "PrivateUse1")
        # torch.tensor(data, device=kiln) copies into the new tensor with the Python dispatch key
        # excluded: copy_ then needs a kiln kernel of its own (the fallback cannot serve it).
        impl.impl("copy_", _copy_kernel, "PrivateUse1")
        # silu_backward has a CompositeImplicitAutograd kernel (sigmoid, fill, sub, mul, add, mul)
        # that PyTorch runs for any backend without a kernel of its own: recorded op by op, it
        # rounded between the ops (bf16: half the gradient's elements off eager's kernel).  With
        # a kiln kernel, the Python key above it sees the op whole and records one node.
        impl.impl("silu_backward", _silu_backward, "PrivateUse1")
        libs = [lib, impl, *autocast.register(), *conversion.install()]
        serialization.install()
        _register.libs = libs  # type: ignore[attr-defined]  # keep registrations alive
        _allow_foreach()
        backward_thread.translate_engine_errors()
        _registered = True
        device_module.pending_probe = _engine_check


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kiln kernel of ``silu_backward``: ATen's formula.  Its presence is what counts; it
    runs only for a kiln tensor without the Python key, which neither recorder makes (the Python
    recorder's take the op at the Python key above it, the native recorder's are PrivateUse2)."""
    s = torch.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return device_module.in_use()  # as ``torch.kiln.is_available()``

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):  # noqa: ANN202 - signature fixed by torch._C._acc.DeviceGuard
        return torch._C._autograd.DeviceType.PrivateUse1


_GUARD = _Guard()


def _backward_reaches_kiln() -> bool:
    """Whether PyTorch's autograd engine can run a backward pass that starts on the kiln device
    (it checks the device against the queues it sized at the process's first backward).

    The probe records into a trace of its own that is dropped unexecuted: it compiles and runs
    nothing, and its tensors (kept alive a while by autograd's reference cycles) can never join
    a later step's graph (their trace generation is never reused)."""
    from kiln.frontends.lazy import trace

    global _probing
    # not under trace._lock: the backward records on the engine's device thread, which takes it
    with trace._lock:
        saved = trace._trace
        trace._trace = trace.Trace(_PROBE_GEN)
    _probing = True
    try:
        # grad mode on: the first use of the device may come inside ``no_grad`` or
        # ``inference_mode`` (``model.to("kiln")``: Module._apply converts under no_grad)
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.zeros((), device="kiln", requires_grad=True)
            torch.autograd.grad(x.view(()), x, torch.ones((), device="kiln"))
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        return False
    finally:
        _probing = False
        x = None
        with trace._lock:
            trace._trace = saved
    return True


_PROBE_GEN = -2  # live traces count up from 0; -1 marks materialized storages
_probing = False  # the engine probe runs: its factories make Python-recorder tensors


def _engine_check() -> str | None:
    """At the first use of the device: make backward passes work on it, or say why they cannot.

    A process whose first backward pass ran before ``import kiln`` has no autograd queue for the
    kiln device; its backward passes then run on the calling thread
    (:mod:`kiln.frontends.lazy.backward_thread`).  The check is itself a backward pass, so it
    waits for the device's first use: after it, PyTorch refuses autograd in forked children."""
    # the guard the engine calls while it unwinds from a raising hook must not call Python
    device_guard.install()
    if _backward_reaches_kiln():
        return None
    backward_thread.install()
    if _backward_reaches_kiln():
        return None
    return (
        "the kiln device cannot run backward passes in this process: a backward pass ran before "
        "kiln registered its device, PyTorch's autograd engine has no queue for it, and running "
        "backward passes on the calling thread did not help either.  Fix: import kiln before the "
        "first backward pass of the process."
    )


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


def _other_accelerator() -> str | None:
    """The accelerator PyTorch uses in this process (cuda, xpu, mps, ...) before Kiln takes the
    PrivateUse1 slot, or None.  Asked only while the slot is unnamed: once it is named, PyTorch
    reports PrivateUse1 as the accelerator whatever else the machine has."""
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


def register_at_import() -> None:
    """``import kiln``: register the kiln device now, unless PyTorch has another accelerator here.

    Naming the PrivateUse1 slot makes PyTorch treat it as the process's accelerator (it is asked
    first, pytorch/pytorch#161129), and the autograd engine then finds no stream for cuda
    tensors: every cuda backward pass fails with an internal assert.  So on a machine with a GPU,
    ``import kiln`` leaves the slot alone (compile mode needs none of it) and :func:`device`
    registers the kiln device when it is first asked for, with a warning.
    """
    if _other_accelerator() is None:
        _register()


class AcceleratorConflictWarning(RuntimeWarning):
    pass


def device(index: int = 0) -> torch.device:
    """The Kiln lazy device, as a ``torch.device`` to pass to ``.to()`` and factory functions."""
    if index != 0:
        raise ValueError(f"Kiln has one lazy device (index 0); got index {index}")
    if not _registered:
        other = _other_accelerator()
        if other is not None:
            warnings.warn(
                f"the kiln device takes PyTorch's PrivateUse1 slot; with {other} present, PyTorch "
                f"then treats the kiln device as this process's accelerator and backward passes on "
                f"{other} tensors fail inside its autograd engine (pytorch/pytorch#161129). "
                f"Train on {other} and on the kiln device in separate processes.",
                AcceleratorConflictWarning,
                stacklevel=2,
            )
        _register()
    device_module.check_usable()
    return torch.device("kiln", 0)


def mark_step() -> None:
    """Cut the pending graph: compile it (cached by structural hash), run it, materialize.
    Both recorders' traces are cut: the Python recorder's, and the native recorder's once it is
    loaded (``config.lazy_recorder = "native"``)."""
    device_module.sync_all()


def sync() -> None:
    """Same as :func:`mark_step`."""
    mark_step()


def optimizer_step(optimizer: torch.optim.Optimizer, **step_kwargs: Any) -> Any:
    """``optimizer.step()`` followed by :func:`mark_step`, as in PyTorch/XLA."""
    loss = optimizer.step(**step_kwargs)
    mark_step()
    return loss
