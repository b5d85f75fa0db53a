"""Module conversions to and from the kiln device, and host pinning, without process-wide effects.

**Parameter swapping, for kiln conversions only.**  ``Module._apply`` (behind ``.to()``,
``.cpu()``, ``.float()``, ``.to_empty()``, ...) changes a parameter in place with ``param.data =``
only when the old and new tensors have the same tensor type; a CPU tensor and a kiln tensor do not,
so it would make a new ``Parameter`` per module -- tied weights untied, references held by an
optimizer left on the old tensors.  PyTorch's switch ``swap_module_params_on_conversion`` makes
``_apply`` swap each parameter in place instead (``torch.utils.swap_tensors``), but it is process
wide.  Kiln turns it on only for the duration of a conversion that involves the kiln device: a
conversion whose target is kiln (``Module.to``, ``to_empty``, ``kiln()``) or of a module that holds
a kiln tensor.  Every other conversion -- and ``load_state_dict`` -- sees the user's own setting.

**What a parameter keeps through the swap.**  ``swap_tensors`` swaps class, ``__dict__`` and
TensorImpl, so a parameter moved to the kiln device lost what eager's ``param.data =`` keeps on a
CPU -> CUDA move: its attributes (``p.no_decay = True``), a ``Parameter`` subclass, and its
gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``), which live on the
TensorImpl's autograd metadata while the Python dicts holding them stay -- a hook registered
before ``model.to(kiln)`` never ran (a gradient-scaling hook left the gradient unscaled,
silently).  Inside kiln conversions the swapped parameter gets its attributes and subclass back
and its hook dicts are set again, which registers them on its new TensorImpl.  A conversion on
the device (``model.to(torch.bfloat16)`` of a kiln model: old and new tensors of one type) assigns
``param.data`` as eager does instead of swapping, which also works while an autograd graph still
holds the parameters (a swap refuses then).

**Pinning.**  Once kiln is PyTorch's accelerator, ``Tensor.pin_memory()`` without a device (what a
``DataLoader(pin_memory=True)`` does) pins for kiln.  The kiln device lives in host memory, so a
pinned copy is an ordinary host copy with the same layout; pinning for any other device goes to
PyTorch's own kernel unchanged.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

_tls = threading.local()
_orig_get_swap = torch.__future__.get_swap_module_params_on_conversion
_installed = False


def _swap_module_params_on_conversion() -> bool:
    """``torch.__future__.get_swap_module_params_on_conversion``, on inside kiln conversions."""
    return _orig_get_swap() or getattr(_tls, "depth", 0) > 0


class _KilnConversion:
    def __enter__(self) -> None:
        _tls.depth = getattr(_tls, "depth", 0) + 1

    def __exit__(self, *exc: object) -> bool:
        _tls.depth -= 1
        return False


_orig_swap_tensors = torch.utils.swap_tensors


# a Python-recorder kiln tensor's own state (lazy/tensor.py) and Parameter's flag for such tensors:
# never carried from one side of a conversion to the other
_TENSOR_STATE = frozenset({"_st", "_chain", "_meta", "_g", "_is_param"})


def _swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors``; inside kiln conversions ``t1`` (the parameter every module
    and optimizer holds) keeps what ``param.data =`` keeps on eager's device moves: its gradient
    hooks, its attributes (``p.no_decay = True``, transformers' ``_is_hf_initialized``) and its
    ``Parameter`` subclass (the native recorder's tensors; the Python recorder's are its own
    class)."""
    if getattr(_tls, "depth", 0) == 0:
        _orig_swap_tensors(t1, t2)
        return
    if torch._has_compatible_shallow_copy_type(t1, t2):
        # a conversion on the device (``model.to(torch.bfloat16)`` of a kiln model): eager's
        # ``param.data =``, which keeps everything and, unlike a swap, works while autograd
        # graphs still hold the parameter (a swap raised "Expected use_count of t1 ...")
        t1.data = t2.data
        return
    own = {k: v for k, v in t1.__dict__.items() if k not in _TENSOR_STATE}
    cls = type(t1)
    _orig_swap_tensors(t1, t2)
    for k, v in own.items():
        t1.__dict__.setdefault(k, v)
    P = torch.nn.Parameter
    if type(t1) is P and cls is not P and isinstance(cls, type) and issubclass(cls, P):
        t1.__class__ = cls
    _rehook(t1)


def _rehook(t: torch.Tensor) -> None:
    """Register ``t``'s hook dicts on its (new) TensorImpl: setting them registers them."""
    hooks = t._backward_hooks
    if hooks is not None:
        t._backward_hooks = hooks
    post = t._post_accumulate_grad_hooks
    if post is not None:
        t._post_accumulate_grad_hooks = post


def _is_kiln(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, str):
        return device.split(":")[0] == "kiln"
    return isinstance(device, torch.device) and device.type == "kiln"


def _holds_kiln(module: torch.nn.Module) -> bool:
    for t in module.parameters():
        if t.device.type == "kiln":
            return True
    for t in module.buffers():
        if t.device.type == "kiln":
            return True
    return False


def _wrap_apply(orig: Any) -> Any:
    @functools.wraps(orig)
    def _apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> Any:
        if getattr(_tls, "depth", 0) == 0 and _holds_kiln(self):
            with _KilnConversion():
                return orig(self, fn, recurse)
        return orig(self, fn, recurse)

    _apply.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return _apply


def _wrap_to(orig: Any) -> Any:
    @functools.wraps(orig)
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
        except Exception:  # noqa: BLE001 - bad arguments: let Module.to raise its own error
            device = None
        if _is_kiln(device):
            with _KilnConversion():
                return orig(self, *args, **kwargs)
        return orig(self, *args, **kwargs)

    to.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return to


def _wrap_to_empty(orig: Any) -> Any:
    @functools.wraps(orig)
    def to_empty(self: torch.nn.Module, *, device: Any, recurse: bool = True) -> Any:
        if _is_kiln(device):
            with _KilnConversion():
                return orig(self, device=device, recurse=recurse)
        return orig(self, device=device, recurse=recurse)

    to_empty.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return to_empty


def _module_kiln(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    """Move all parameters and buffers to the kiln device (``model.kiln()``), swapping each
    parameter in place so that tied weights and held references stay valid."""
    from kiln.frontends.lazy.device_module import _index

    target = torch.device("kiln", _index(device))
    with _KilnConversion():
        return self._apply(lambda t: t.to(target))


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    if device is None or _is_kiln(device):
        out = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device="cpu")
        out.copy_(self)
        return out
    op = torch.ops.aten._pin_memory.default
    return op._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, self, device)


def install() -> list[torch.library.Library]:
    """Install the scoped swap and the host pinning kernel (once per process)."""
    global _installed
    if _installed:
        return []
    M = torch.nn.Module
    M._apply = _wrap_apply(M._apply)
    M.to = _wrap_to(M.to)
    M.to_empty = _wrap_to_empty(M.to_empty)
    M.kiln = _module_kiln
    torch.__future__.get_swap_module_params_on_conversion = _swap_module_params_on_conversion
    torch.utils.swap_tensors = _swap_tensors
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    _installed = True
    return [lib]
