"""The native recorder as the kiln device's recorder (the default since 2026-12-01).

With ``kiln.config.lazy_recorder == "native"`` (the default; ``KILN_LAZY_RECORDER=python`` picks
the Python recorder), the tensors the kiln device makes are native tensors (``recorder.cpp``'s
``NativeImpl``), not the Python recorder's ``LazyTensor``:

- factories with ``device=kiln`` (``torch.zeros(..., device=dev)``, ``torch.empty``, the composite
  factories ``arange``/``full``/..., ``torch.tensor(data, device=dev)``) reach the kiln
  device's PrivateUse1 kernels (``lazy/device.py``), which hand them to :func:`factory`: those
  Kiln lowers (``empty``, ``zeros``, ``ones``, ``full``, ``arange``, ``linspace``, ``eye``,
  ``scalar_tensor``) are graph nodes, as on the Python recorder, random ones (``randn``,
  ``rand``, ``randint``, ``randperm``) seeded nodes (stage 5: the Python recorder's values
  under one seed); any other (``empty_permuted``) runs on the CPU and its result becomes a
  native tensor holding that value -- no node, no sync;
- ``.to(dev)`` is PyTorch's ``_to_copy``: an ``empty`` on the kiln device (a factory, above) and a
  ``copy_`` from the CPU into it, which the recorder's fallback takes as an upload (the value is
  copied at copy time; later writes to the CPU tensor are not seen);
- printing a native tensor runs the pending step (a counted forced sync, reason ``print``) and
  prints its value with ``device='kiln:0'``, as the Python recorder's ``LazyTensor.__repr__``;
- ``torch.save`` pickles a native tensor as the CPU tensor it holds (``serialization.reduce_lazy``),
  so the file is an ordinary CPU checkpoint, as for ``LazyTensor``;
- a CPU tensor operand with dimensions is eager's mixed-device error
  (``fallback.check_cpu_operand``), 0-dim CPU tensors and CPU index tensors are allowed, as on the
  Python recorder's device;
- ``kiln.mark_step()`` cuts the native trace too (``lazy/device.py``).

Why the native tensor keeps its own dispatch key (PrivateUse2) instead of moving to PrivateUse1:
the tensor's *device* is already ``kiln:0`` (``DeviceType::PrivateUse1``: device guard, autograd
engine queue, ``x.device == kiln.device()``), and the dispatch key only decides which kernels see
it.  On PrivateUse2 the kiln device's Python registrations (its PrivateUse1 factory fallback,
composite factories, ``copy_`` kernel, autocast kernels) stay where they are and keep serving the
Python recorder, so the switch is a per-call choice in those kernels and both recorders can live
in one process (tests switch per module); moving the table to PrivateUse1 would make the two
recorders exclusive per process (a dispatch key has one fallback) and need the switch before
``import kiln``.  Nothing else dispatches on the key: every op whose arguments include a native
tensor reaches the recorder (PrivateUse2 is the highest backend bit), factories reach the device's
kernels through their ``device=`` argument, and that is where the switch acts.  The one key
PyTorch derives from the backend that matters here, autocast (PrivateUse2 has none), is given
explicitly: ``NativeImpl`` carries AutocastPrivateUse1, so ``torch.autocast("kiln")`` reaches the
kiln autocast kernels (``lazy/autocast.py``).

``data_ptr()`` and ``untyped_storage()`` of a native tensor (its c10 storage is a data-less
handle, there for PyTorch's aliasing checks) answer with the host buffer holding its value, pending
work run first, as ``LazyTensor`` does (libraries that save state dicts -- safetensors,
``save_pretrained`` -- find shared tensors by them).  PyTorch's methods are C methods of
``TensorBase``, so this wraps them on ``torch.Tensor`` (once the native device is first used;
every other tensor goes through the wrapper to PyTorch's method: a CPU tensor's ``data_ptr()``
59 -> 148 ns of thread CPU, medians of 5, load ~7; the check is `is_cpu` since native tensors
have a storage handle: 90 -> 154 ns, best of 5).

Where the recorder cannot be built or loaded (no C++ compiler, a failed build), the switch
falls back: :func:`usable` answers False, the kiln device keeps making the Python recorder's
tensors, and the process gets one :class:`NativeRecorderUnavailableWarning` naming the reason and
the fix, counted once (``metrics`` ``native_recorder_unavailable``).

Needs: the recorder extension (``native.load``), the kiln device registered.  Guarantees:
nothing changes while the switch is off (the kiln device's kernels ask :func:`usable` per call,
and nothing here is installed until the first native factory call); with the switch on and no
recorder, the kiln device is the Python recorder's (one warning, counted), never an error.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map

from kiln import metrics
from kiln.config import config

_CPU = torch.device("cpu")
_installed = False
_install_lock = threading.Lock()
# why the native recorder cannot serve the kiln device in this process, once a load failed
_unavailable: list[str] = []


class NativeRecorderUnavailableWarning(RuntimeWarning):
    """``lazy_recorder = "native"`` was asked for, but the recorder cannot be built or loaded
    here: the kiln device uses the Python recorder instead."""


def active() -> bool:
    """Whether kiln-device factories make native tensors now (the switch is on and the recorder
    has not failed to load; asks nothing, builds nothing)."""
    return config.lazy_recorder == "native" and not _unavailable


def usable() -> bool:
    """Whether the kiln device's factories make native tensors: the switch is on and the
    recorder loads (built on first use).  Where it cannot be built or loaded, the first call
    warns once (:class:`NativeRecorderUnavailableWarning`, the reason and the fix), counts
    ``native_recorder_unavailable`` and answers False from then on: the Python recorder serves
    the kiln device for the rest of the process."""
    if config.lazy_recorder != "native" or _unavailable:
        return False
    from kiln.frontends.lazy import native

    if native.loaded():
        return True
    try:
        native.load()
    except native.NativeUnavailable as e:
        _fall_back(str(e))
        return False
    return True


def _fall_back(reason: str) -> None:
    with _install_lock:
        if _unavailable:
            return
        _unavailable.append(reason)
    metrics.incr("native_recorder_unavailable")
    warnings.warn(
        "Kiln: the native lazy recorder was asked for (kiln.config.lazy_recorder = 'native', "
        f"KILN_LAZY_RECORDER=native) but cannot be used here: {reason}  The kiln device uses the "
        "Python recorder instead (same results, more recording time per op).  Fix: install a C++ "
        "compiler (g++, or point CXX at one) and PyTorch's C++ headers, or set "
        "KILN_LAZY_RECORDER=python to choose the Python recorder without this warning.",
        NativeRecorderUnavailableWarning,
        stacklevel=2,
    )


def factory(func: Any, args: tuple, kwargs: dict) -> Any:
    """A factory op with ``device=kiln`` under the native recorder: a graph node (:func:`_as_node`),
    or computed on the CPU, its result a native tensor holding the value (no node, no sync)."""
    from kiln.frontends.lazy import native

    mod = native.load()
    install()
    if _as_node(func):
        return native.factory(func, args, kwargs)
    kw = {k: (_CPU if _is_kiln(v) else v) for k, v in kwargs.items()}
    if "device" not in kw:
        kw["device"] = _CPU
    out = func(*[(_CPU if _is_kiln(a) else a) for a in args], **kw)

    def wrap(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return mod.from_cpu(o.detach())
        return o

    return tree_map(wrap, out)


def install() -> None:
    """Printing and pickling of native tensors (once, at the first native factory call)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        import torch._tensor_str as tensor_str

        tensor_str._str = _wrap_str(tensor_str._str)
        torch.Tensor._reduce_ex_internal = _wrap_reduce(torch.Tensor._reduce_ex_internal)
        torch.Tensor.untyped_storage = _wrap_host(torch.Tensor.untyped_storage)
        torch.Tensor.data_ptr = _wrap_host(torch.Tensor.data_ptr)
        _installed = True


def backward_error(where: str, exc: BaseException) -> str:
    """An error left recording ``where`` (``aten.cos.default``) on a native tensor inside a
    backward pass (recorder.cpp's ``guarded``, stage 4): kept as
    ``lazy.tensor.last_backward_error`` and counted (``backward_errors``), as the Python
    recorder's ``_BackwardError`` does; returns the message ``backward()`` raises."""
    from kiln import metrics
    from kiln.frontends.lazy import tensor as lazy_tensor

    lazy_tensor.last_backward_error = exc
    metrics.incr("backward_errors")
    return (
        f"[kiln] the backward pass failed on the kiln device in {where}: "
        f"{type(exc).__name__}: {exc}"
    )


def _wrap_str(orig: Any) -> Any:
    def _str(self: torch.Tensor, *, tensor_contents: Any = None) -> str:
        from kiln.frontends.lazy import native

        if self.device.type == "kiln" and native.is_native(self):
            v = native.value_for(self, "print")
            body = orig(v, tensor_contents=tensor_contents)
            return body[:-1] + ", device='kiln:0')" if body.endswith(")") else body
        return orig(self, tensor_contents=tensor_contents)

    _str.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return _str


def _wrap_reduce(orig: Any) -> Any:
    def _reduce_ex_internal(self: torch.Tensor, proto: int) -> tuple:
        from kiln.frontends.lazy import native
        from kiln.frontends.lazy.serialization import reduce_lazy

        if self.device.type == "kiln" and native.is_native(self):
            return reduce_lazy(self, native.value_for(self, "save"), proto)
        return orig(self, proto)

    _reduce_ex_internal.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return _reduce_ex_internal


def _wrap_host(orig: Any) -> Any:
    """``data_ptr`` / ``untyped_storage`` of a native tensor: those of the host buffer holding
    its value (pending work runs first, a forced sync counted as ``storage``), as
    ``LazyTensor`` answers them; every other tensor goes to PyTorch's method unchanged."""

    def method(self: torch.Tensor) -> Any:
        if self.is_cpu:  # (the fast way out)
            return orig(self)
        if self.device.type == "kiln" and type(self) is not _lazy_type():
            from kiln.frontends.lazy import native

            if native.is_native(self):
                return orig(native.value_for(self, "storage"))
        return orig(self)

    method.__name__ = orig.__name__
    method.__doc__ = orig.__doc__
    method.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return method


def _lazy_type() -> type:
    from kiln.frontends.lazy.tensor import LazyTensor

    return LazyTensor


_AS_NODE: dict[Any, bool] = {}


def _as_node(func: Any) -> bool:
    """Whether a factory is recorded as a graph node, as the Python recorder records it: a
    random one (``randn``, ``rand``, ``randint``, ``randperm``; lowered to ``Category.RANDOM``)
    as a seeded node, one that Kiln lowers (``empty``, ``empty_strided``, ``zeros``, ``ones``,
    ``full``, ``arange``, ``linspace``, ``eye``, ``scalar_tensor``: ``Category.FACTORY``) as a
    plain node.  ``.to(dev)`` allocates through ``empty`` and then uploads over it (the node is
    dead: the cut prunes it).  (A call with ``generator=`` never gets here: PyTorch decomposes
    it into ``empty`` and an in-place draw, which stage 5 records.)"""
    r = _AS_NODE.get(func)
    if r is None:
        from kiln.frontends.lazy.native import rng
        from kiln.ir.graph import Node
        from kiln.ir.ops import Category
        from kiln.lowering.aten import op_name

        name, real = op_name(func)
        r = (torch.Tag.nondeterministic_seeded in func.tags and rng.is_random_node(func)) or (
            real and Node(name).category is Category.FACTORY
        )
        _AS_NODE[func] = r
    return r


def _is_kiln(v: Any) -> bool:
    return isinstance(v, torch.device) and v.type == "kiln"
