"""``torch.save`` / ``torch.load`` of kiln tensors.

Saving: a kiln tensor pickles as the CPU tensor it holds (pending lazy work runs first), a kiln
parameter as a CPU ``nn.Parameter``.  The file is an ordinary PyTorch checkpoint: it loads without
Kiln, or with Kiln and no ``map_location``, as CPU tensors (as ``xm.save`` files do for PyTorch/XLA).

Loading onto the device: ``torch.load(f, map_location="kiln")`` (also ``"kiln:0"``,
``torch.device("kiln")``, or a dict mapping locations to kiln) loads to the CPU and moves every
tensor, parameter and module of the result to the kiln device, keeping tensors that were shared
in the file shared.  Kiln's device has no storages of its own that PyTorch's storage
deserializers could fill, so this is done around ``torch.load``; every other ``map_location`` goes
to PyTorch unchanged.  A kiln location that does not exist (``"kiln:7"``) raises, naming the valid
ones, and a storage that would still be restored to kiln some other way (a callable) raises
instead of reaching PyTorch's storage copy, which cannot create kiln storages.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import torch

_installed = False


def reduce_lazy(t: torch.Tensor, protocol: int) -> tuple:
    """``LazyTensor.__reduce_ex__``: pickle the materialized CPU value."""
    cpu = t.detach().cpu()
    if getattr(t, "_is_param", False):
        return (torch._utils._rebuild_parameter, (cpu, t.requires_grad, OrderedDict()))
    if t.requires_grad:
        cpu.requires_grad_(True)
    return cpu.__reduce_ex__(protocol)


def _kiln_target(map_location: Any) -> torch.device | None:
    """The kiln device ``map_location`` asks for, or None when it is not (only) about kiln."""
    from kiln.frontends.lazy.device_module import _index

    if isinstance(map_location, dict):
        targets = {str(v) for v in map_location.values()}
        kiln = [v for v in targets if v.split(":")[0] == "kiln"]
        if not kiln:
            return None
        if len(targets) != len(kiln) or len(set(kiln)) != 1:
            raise ValueError(
                f"map_location {map_location!r} mixes the kiln device with other devices; "
                "map every location to 'kiln' or load to the CPU and move tensors yourself"
            )
        map_location = kiln[0]
    if isinstance(map_location, str):
        if map_location.split(":")[0] != "kiln":
            return None
        map_location = torch.device(map_location)
    if isinstance(map_location, torch.device) and map_location.type == "kiln":
        return torch.device("kiln", _index(map_location))
    return None


def _to_kiln(obj: Any, dev: torch.device, memo: dict[int, Any]) -> Any:
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.nn.Parameter):
        out: Any = torch.nn.Parameter(obj.detach().to(dev), requires_grad=obj.requires_grad)
    elif isinstance(obj, torch.Tensor):
        out = obj.detach().to(dev).requires_grad_(obj.requires_grad)
    elif isinstance(obj, torch.nn.Module):
        out = obj.to(dev)
    elif isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else obj
        memo[key] = out
        items = [(k, _to_kiln(v, dev, memo)) for k, v in obj.items()]
        for k, v in items:
            out[k] = v
        return out
    elif isinstance(obj, list):
        out = [_to_kiln(v, dev, memo) for v in obj]
    elif isinstance(obj, tuple):
        vals = [_to_kiln(v, dev, memo) for v in obj]
        out = type(obj)(*vals) if hasattr(obj, "_fields") else type(obj)(vals)
    else:
        out = obj
    memo[key] = out
    return out


def _wrap_load(orig: Any) -> Any:
    @functools.wraps(orig)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        dev = _kiln_target(map_location)
        if dev is None:
            return orig(f, map_location, *args, **kwargs)
        obj = orig(f, "cpu", *args, **kwargs)
        return _to_kiln(obj, dev, {})

    load.__kiln_wrapped__ = orig  # type: ignore[attr-defined]
    return load


def _kiln_tag(obj: Any) -> None:
    return None  # kiln tensors are saved as CPU tensors: no storage is ever tagged kiln


def _kiln_deserialize(obj: Any, location: str) -> Any:
    if location.split(":")[0] == "kiln":
        raise RuntimeError(
            f"cannot restore a storage directly onto {location}: the kiln device has no storages "
            "of its own. Use torch.load(f, map_location='kiln') (Kiln moves the loaded tensors), "
            "or load to the CPU and call .to(kiln.device())"
        )
    return None


def install() -> None:
    """Wrap ``torch.load`` for kiln map_locations and guard storage restores (once)."""
    global _installed
    if _installed:
        return
    torch.load = _wrap_load(torch.load)
    # before PyTorch's own PrivateUse1 deserializer (priority 23), which would try to allocate
    # a storage on the kiln device
    torch.serialization.register_package(19, _kiln_tag, _kiln_deserialize)
    _installed = True
