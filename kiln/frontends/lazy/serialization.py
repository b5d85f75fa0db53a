"""``torch.save`` / ``torch.load`` of kiln tensors.

Saving: a kiln tensor pickles as the CPU tensor it holds (pending lazy work runs first), a kiln
parameter as a CPU ``nn.Parameter``; tensors that share a storage on the device share it in the
file (views stay views).  The file is an ordinary PyTorch checkpoint: it loads without
Kiln, or with Kiln and no ``map_location``, as CPU tensors (as ``xm.save`` files do for PyTorch/XLA).

Loading onto the device: ``torch.load(f, map_location="kiln")`` (also ``"kiln:0"``,
``torch.device("kiln")``, or a dict mapping locations to kiln) loads to the CPU and moves every
tensor, parameter and module of the result to the kiln device, keeping tensors that were shared
in the file shared (the same tensor twice: one kiln tensor; views of one storage: kiln views of
one storage).  Kiln's device has no storages of its own that PyTorch's storage
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


def reduce_lazy(t: torch.Tensor, host: torch.Tensor, protocol: int) -> tuple:
    """``__reduce_ex__`` of a kiln tensor ``t`` whose value is ``host``: the CPU tensor viewing
    the host buffer that holds ``t``'s storage (pending work run), not a copy, so that kiln
    tensors sharing a storage (``x`` and ``x[2:4]``) share it in the file, as CPU tensors do."""
    cpu = host.detach()
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


def _by_storage(obj: Any, groups: dict[int, list[torch.Tensor]], seen: set[int]) -> None:
    """The loaded CPU tensors in ``obj``'s dicts, lists and tuples, by the storage they view."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.layout == torch.strided:
            groups.setdefault(obj.untyped_storage().data_ptr(), []).append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _by_storage(v, groups, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _by_storage(v, groups, seen)


def _shared_views(obj: Any, dev: torch.device) -> dict[int, torch.Tensor]:
    """Kiln views (by ``id`` of the loaded tensor) for tensors that share a storage in the file:
    the storage moves once and each tensor becomes a view of it, so that ``x`` and ``x[2:4]``
    loaded together stay aliased, as ``torch.load`` keeps them on the CPU.  Tensors alone on
    their storage (or sharing one with another dtype) move by themselves."""
    groups: dict[int, list[torch.Tensor]] = {}
    _by_storage(obj, groups, set())
    views: dict[int, torch.Tensor] = {}
    for ptr, ts in groups.items():
        dtypes = {t.dtype for t in ts}
        if len(ts) < 2 or ptr == 0 or len(dtypes) != 1:
            continue
        storage = ts[0].untyped_storage()
        n = storage.nbytes() // ts[0].element_size()
        flat = torch.empty(0, dtype=ts[0].dtype).set_(storage, 0, (n,), (1,)).to(dev)
        for t in ts:
            views[id(t)] = flat.as_strided(t.size(), t.stride(), t.storage_offset())
    return views


def _to_kiln(obj: Any, dev: torch.device, memo: dict[int, Any], views: dict[int, Any]) -> Any:
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.Tensor) and key in views:
        out: Any = views[key]
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        else:
            out.requires_grad_(obj.requires_grad)
    elif isinstance(obj, torch.nn.Parameter):
        out = torch.nn.Parameter(obj.detach().to(dev), requires_grad=obj.requires_grad)
    elif isinstance(obj, torch.Tensor):
        out = obj.detach().to(dev).requires_grad_(obj.requires_grad)
    elif isinstance(obj, torch.nn.Module):
        out = obj.to(dev)
    elif isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else obj
        memo[key] = out
        items = [(k, _to_kiln(v, dev, memo, views)) for k, v in obj.items()]
        for k, v in items:
            out[k] = v
        return out
    elif isinstance(obj, list):
        out = [_to_kiln(v, dev, memo, views) for v in obj]
    elif isinstance(obj, tuple):
        vals = [_to_kiln(v, dev, memo, views) for v in obj]
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
        return _to_kiln(obj, dev, {}, _shared_views(obj, dev))

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
