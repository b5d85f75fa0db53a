"""The native recorder's ``out=`` ops, ``resize_`` and ``set_`` on the kiln device (stage 8):
calls that write a tensor outside the in-place path (``Handler.inplace``), with eager's semantics.

- An ``out=`` op that keeps its outputs' geometry (``Handler.keeps_out_geometry``) is recorded as
  its functional overload (``sum.IntList_out`` -> ``sum.dim_IntList``, ``mm.out`` ->
  ``mm.default``) and each output then ``copy_``-ed into its ``out`` tensor, which the in-place
  path records (a whole storage or a view: a write-back, no sync): :func:`record_out`.
- ``resize_``, ``set_`` and ``out=`` ops that resize: :func:`reshape_in_place`.

Needs: the Python fallback's handler (``fallback.Handler``), the recorder's ``become``,
``from_cpu``, ``lend``, ``value``.  Guarantees: eager's values and aliasing; an op it cannot
record is left to the caller (``NOT_DONE``) or runs on the values (a counted forced sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from kiln import metrics

if TYPE_CHECKING:
    from kiln.frontends.lazy.native.fallback import Handler, _Op

aten = torch.ops.aten
_CPU = torch.device("cpu")
NOT_DONE = object()  # the caller does it another way


def written(op: _Op, args: tuple, kwargs: dict) -> list:
    """The tensors an in-place or out= call writes (its schema's mutated arguments, tensor lists
    flattened), in argument order."""
    targets: list = []
    for i in op.facts.mutated:
        a = args[i] if i < len(args) else kwargs.get(op.func._schema.arguments[i].name)
        targets.extend(a if isinstance(a, (list, tuple)) else [a])
    return targets


def is_out(func: Any, kwargs: dict) -> bool:
    """An ``out=`` call by its overload's name or an ``out`` argument (``mm.out``)."""
    return "out" in kwargs or func._overloadname.endswith("out")


def writes_outputs(func: Any, kwargs: dict) -> bool:
    """An ``out=`` overload by its schema too (``max.dim_max``, whose outputs are named
    otherwise): what the kiln device records or resizes (with the switch off, only
    :func:`is_out` calls are refused, as before)."""
    r = _IS_OUT.get(func)
    if r is None:
        r = _IS_OUT[func] = any(a.is_out for a in func._schema.arguments)
    return r or is_out(func, kwargs)


_IS_OUT: dict[Any, bool] = {}


def cpu_device(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type == "kiln":
        return _CPU
    return a


_FUNCTIONAL: dict[Any, Any] = {}


def out_functional(func: Any) -> Any | None:
    """The functional overload of an ``out=`` overload: same packet, the same arguments without
    the ``out`` ones (``mm.out`` -> ``mm.default``, ``mm.dtype_out`` -> ``mm.dtype``); None when
    there is none."""
    if func in _FUNCTIONAL:
        return _FUNCTIONAL[func]
    want = [(a.name, str(a.type)) for a in func._schema.arguments if not a.is_out]
    packet = getattr(aten, func._schema.name.split("::")[1])
    found = None
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        s = cand._schema
        if cand is func or any(a.is_out for a in s.arguments) or s.is_mutable:
            continue
        if [(a.name, str(a.type)) for a in s.arguments] == want:
            found = cand
            break
    _FUNCTIONAL[func] = found
    return found


def record_out(h: Handler, op: _Op, args: tuple, kwargs: dict) -> Any:
    """An ``out=`` op that keeps its outputs' geometry: its functional overload recorded, each
    result copied into its ``out`` tensor (``copy_``: recorded by the in-place path, or run on
    the values where that cannot take it).  ``NOT_DONE`` when there is no functional overload
    or its results do not match the outputs."""
    func = op.func
    fn = out_functional(func)
    if fn is None:
        return NOT_DONE
    names = {a.name for a in func._schema.arguments if a.is_out}
    targets = written(op, args, kwargs)
    res = fn(*args, **{k: v for k, v in kwargs.items() if k not in names})
    outs = list(res) if isinstance(res, (list, tuple)) else [res]
    if len(outs) != len(targets) or not all(
        isinstance(v, torch.Tensor) and v.shape == t.shape for v, t in zip(outs, targets)
    ):
        return NOT_DONE  # (the recorded nodes are dead: the cut prunes them)
    for t, v in zip(targets, outs):
        t.copy_(v)
    return targets[0] if len(targets) == 1 else tuple(targets)


def reshape_in_place(h: Handler, op: _Op, args: tuple, kwargs: dict) -> Any:
    """``resize_``, ``set_`` and ``out=`` ops that resize their outputs, on native tensors
    with the native recorder as the kiln device's (eager's semantics):

    - ``x.set_(y)`` (``y`` native): ``x`` takes ``y``'s storage, view chain and geometry
      (``become``: no node, no sync; both see each other's writes); ``x.set_()``: ``x``
      becomes an empty tensor on a storage of its own;
    - ``resize_`` and ``out=``: run on the values after the pending work (a forced sync,
      counted as a fallback): each written tensor's CPU value is resized by the op itself
      (shrinking keeps the buffer, growing keeps the old elements); a tensor whose geometry
      changed becomes a native tensor over that value, its buffer shared with its old
      storage (both marked, so that writes through either land in it, as in eager)."""
    func = op.func
    x = args[0]
    if func is aten.set_.source_Tensor:
        src = args[1]
        if not (isinstance(src, torch.Tensor) and h.mod.is_native(src)):
            h.check_devices(func, (src,), {})
            raise RuntimeError(
                f"Kiln native recorder: {func} of a native kiln tensor needs a kiln tensor "
                f"source, got one on {getattr(src, 'device', None)}; move it with "
                ".to(kiln.device()) first"
            )
        if src.dtype != x.dtype:
            raise RuntimeError(
                f"Could not set tensor of type {src.dtype} to a tensor of type {x.dtype}"
            )
        h.mod.become(x, src)
        return x
    if func is aten.set_.default:
        h.mod.become(x, h.mod.from_cpu(torch.empty(0, dtype=x.dtype)))
        return x
    if func not in (aten.resize_.default,) and not is_out(func, kwargs):
        raise NotImplementedError(
            f"Kiln native recorder: {func} (setting a tensor to another storage) is not "
            "supported on the kiln device; fix: x.set_(y) with y a kiln tensor, or make a "
            "new tensor"
        )
    name = op.facts.name
    metrics.fallback(name)
    h.sync(f"op:{name}")
    targets = written(op, args, kwargs)
    # (a new tensor over each value: ``value`` may be the storage's own data tensor, whose
    # geometry the op must not change)
    cpu = {id(t): h.mod.value(t).detach() for t in targets}

    def conc(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and h.mod.is_native(a):
            c = cpu.get(id(a))
            return c if c is not None else h.mod.value(a)
        return cpu_device(a)

    out = func(*tree_map(conc, args), **tree_map(conc, kwargs))
    for t in targets:
        c = cpu[id(t)]
        if (
            tuple(c.shape) != tuple(t.shape)
            or c.stride() != t.stride()
            or (c.storage_offset() != t.storage_offset())
        ):
            h.mod.lend(t)
            h.mod.become(t, h.mod.from_cpu(c.detach(), True))
    by_cpu = {id(c): t for t, c in ((t, cpu[id(t)]) for t in targets)}
    return tree_map(lambda o: by_cpu.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)
