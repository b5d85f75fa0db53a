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
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    _installed = True
    return [lib]
