"""``torch.autocast("kiln", dtype=...)``: autocast kernels for the kiln device.

PyTorch registers no autocast kernels for the PrivateUse1 slot, so without these
``torch.autocast("kiln")`` would change nothing.  Kiln applies eager CPU autocast's rules to kiln
tensors: the ops that have a CPU autocast kernel (``AutocastCPU`` in the dispatcher), each with
CPU's policy --

- lower precision (matmuls, convolutions, linear, attention, prelu): floating kiln tensors other
  than float64 are cast to the autocast dtype;
- promote (``cat``, ``stack``, ``index_copy``): cast to the widest floating type among them;
- float32 (losses, reductions such as ``prod``, FFTs, linear algebra, ...): cast to float32;

then the op runs with kiln autocast off, as in eager.  Every other op runs in its inputs' dtypes.
The list of ops is read from the dispatcher at registration, so it follows the installed
PyTorch; the policy of an op is CPU's (autocast_mode.cpp), with float32 as the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LOWER = {
    "conv1d",
    "conv2d",
    "conv3d",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "_addmm_activation",
    "addbmm",
    "linear",
    "mkldnn_reorder_linear_weight",
    "_convolution",
    "matmul",
    "conv_tbc",
    "mkldnn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
}
_PROMOTE = {"stack", "cat", "index_copy"}

_KEY = torch._C.DispatchKey.AutocastPrivateUse1


def policy(op_name: str) -> str:
    """``"lower"``, ``"promote"`` or ``"fp32"`` for an ATen op name (without overload)."""
    if op_name in _LOWER:
        return "lower"
    if op_name in _PROMOTE:
        return "promote"
    return "fp32"


def _eligible(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == "kiln"
        and t.is_floating_point()
        and t.dtype is not torch.float64
    )


def _map_tensors(fn: Callable[[torch.Tensor], Any], a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return fn(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_map_tensors(fn, x) for x in a)
    return a


def _cast(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if _eligible(t) and t.dtype != dtype else t

    return (
        tuple(_map_tensors(cast, a) for a in args),
        {k: _map_tensors(cast, v) for k, v in kwargs.items()},
    )


def _widest(args: tuple, kwargs: dict) -> torch.dtype:
    low = torch.get_autocast_dtype("kiln")
    out = low
    found: list[torch.dtype] = []
    _map_tensors(lambda t: found.append(t.dtype) if _eligible(t) else None, (args, kwargs))
    for d in found:
        if d is torch.float32 or out is torch.float32:
            out = torch.float32
        elif d is not low:
            raise RuntimeError(f"kiln autocast: unexpected floating dtype {d} among {found}")
    return out


def _kernel(op: Any, kind: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            if kind == "lower":
                dtype = torch.get_autocast_dtype("kiln")
            elif kind == "promote":
                dtype = _widest(args, kwargs)
            else:
                dtype = torch.float32
            args, kwargs = _cast(args, kwargs, dtype)
            return op(*args, **kwargs)

    return kernel


def register() -> list[torch.library.Library]:
    """Register the kiln autocast kernels; returns the libraries (keep them alive)."""
    impl = torch.library.Library("aten", "IMPL")
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    for qualname in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
        ns, _, full = qualname.partition("::")
        if ns != "aten":
            continue
        name, _, overload = full.partition(".")
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or (overload or "default") not in packet.overloads():
            continue
        op = getattr(packet, overload or "default")
        impl.impl(full, _kernel(op, policy(name)), "AutocastPrivateUse1")
    return [impl, fallthrough]
