"""ATen -> Kiln IR.

Both frontends (the lazy device and the torch.compile backend) see ATen calls; this module turns one
call into one Kiln node.  An ATen op is a Kiln op when its packet is in the op table
(:mod:`kiln.ir.ops`) and not in the fallback table; anything else becomes an ``opaque`` node that
runs through ATen, counted in the metrics under its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kiln import metrics
from kiln.ir.graph import In, Node, TensorType
from kiln.ir.ops import ON_CHANGE, OPS, Category
from kiln.lowering.fallback import reason


@dataclass(frozen=True)
class Ref:
    """A value that lives in the graph under construction (node id)."""

    id: int


_NAMES: dict[Any, tuple[str, bool]] = {}
ON_CHANGE.append(_NAMES.clear)  # a new or removed op record changes what lowers to what


def op_name(func: Any) -> tuple[str, bool]:
    """Kiln op name for an ATen overload, and whether it is a real (non-opaque) Kiln op."""
    hit = _NAMES.get(func)
    if hit is None:
        hit = _NAMES[func] = _op_name(func)
    return hit


def _op_name(func: Any) -> tuple[str, bool]:
    schema = func._schema
    ns, _, name = schema.name.partition("::")
    overload = func._overloadname
    d = OPS.get(name)  # fallback ops have no record in OPS
    if d is not None and d.namespace == ns:
        if d.category not in (Category.OPAQUE, Category.META) or name == "sym_size":
            return f"{name}.{overload}", True
    return f"opaque.{schema.name}.{overload}", False


def template(args: Any, kwargs: dict, ref_of: Callable[[Any], Ref | None]):
    """Replace every graph value in (args, kwargs) by an ``In(k)`` marker.

    ``ref_of(x)`` returns the :class:`Ref` for a value that is (or must become) a graph value, or
    None for a value to keep in the template as a constant attribute.
    """
    inputs: list[int] = []

    def walk(x: Any) -> Any:
        r = ref_of(x)
        if r is not None:
            inputs.append(r.id)
            return In(len(inputs) - 1)
        if isinstance(x, (list, tuple)):
            return tuple(walk(y) for y in x)
        if isinstance(x, torch.Tensor):
            raise TypeError("tensor argument with no graph value")
        return x

    targs = tuple(walk(a) for a in args)
    tkwargs = tuple((k, walk(v)) for k, v in kwargs.items())
    return targs, tkwargs, tuple(inputs)


def lower_call(
    func: Any,
    args: Any,
    kwargs: dict,
    ref_of: Callable[[Any], Ref | None],
    types: tuple[TensorType | None, ...],
) -> Node:
    """One ATen call -> one Kiln node (opaque if Kiln has no rule for it; counted)."""
    name, real = op_name(func)
    if not real:
        metrics.fallback(func._schema.name.split("::")[-1])
    targs, tkwargs, inputs = template(args, kwargs, ref_of)
    return Node(name, inputs, targs, tkwargs, types)


def fallback_reason(func: Any) -> str:
    return reason(func._schema.name.split("::")[-1])
