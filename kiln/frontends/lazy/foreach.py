"""Multi-tensor (``_foreach_*``) ops on lazy tensors, recorded one tensor at a time.

``torch.optim``'s default (foreach) path updates every parameter with one ``_foreach_*`` call per
step of the rule.  Recorded whole, such a call is one node that ATen runs, returning new buffers.
Recorded as the per-tensor op it applies (``_foreach_addcdiv.ScalarList(ps, a, b, s)`` ->
``addcdiv(ps[i], a[i], b[i], value=s[i])`` for each i), each parameter's update is a chain of
pointwise nodes that the backend fuses into one kernel, written back into the parameter's and the
optimizer state's own buffers (see ``trace._donate``): no new buffers per step, no ATen call.

The per-tensor overload is the one of the op without ``_foreach_`` whose arguments take, in
order, the element types of the foreach overload's (``Tensor[]`` -> ``Tensor``, ``Scalar[]`` ->
``Scalar``; a single ``Tensor`` or ``Scalar`` is passed to every call), its remaining arguments
having defaults.  Foreach ops with no such overload (``_foreach_norm``, ``_foreach_addcdiv.Tensor``
with a tensor of scalars) are recorded whole, as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten

# foreach ops split into per-tensor pointwise ops (value-preserving: the same ATen op per element)
_SPLIT = {
    "_foreach_add",
    "_foreach_sub",
    "_foreach_mul",
    "_foreach_div",
    "_foreach_addcdiv",
    "_foreach_addcmul",
    "_foreach_lerp",
    "_foreach_sqrt",
    "_foreach_rsqrt",
    "_foreach_neg",
    "_foreach_abs",
    "_foreach_exp",
    "_foreach_log",
    "_foreach_reciprocal",
    "_foreach_sign",
    "_foreach_maximum",
    "_foreach_minimum",
    "_foreach_clamp_min",
    "_foreach_clamp_max",
}
# schema type (as torch spells it) -> the per-tensor call's type: Tensor[] / Scalar[] -> element
_ELEM = {"List[Tensor]": "Tensor", "List[number]": "number", "Tensor": "Tensor", "number": "number"}


class Split:
    """How to record one foreach overload as per-tensor calls of ``op``."""

    __slots__ = ("defaults", "kw_names", "listed", "names", "op", "positional")

    def __init__(self, fe: Any, op: Any) -> None:
        fargs = fe._schema.arguments
        self.op = op
        self.names = [a.name for a in fargs]
        self.listed = [str(a.type).startswith("List[") for a in fargs]  # one value per tensor
        self.defaults = [a.default_value if a.has_default_value() else None for a in fargs]
        pargs = op._schema.arguments
        # where each value goes in the per-tensor call: positional index, or keyword name
        self.positional = [not pargs[j].kwarg_only for j in range(len(fargs))]
        self.kw_names = [pargs[j].name for j in range(len(fargs))]

    def calls(self, args: tuple, kwargs: dict) -> list[tuple[list, dict]] | None:
        """(args, kwargs) of each per-tensor call, or None when the lists differ in length."""
        vals = []
        for j, name in enumerate(self.names):
            if j < len(args):
                vals.append(args[j])
            elif name in kwargs:
                vals.append(kwargs[name])
            else:
                vals.append(self.defaults[j])
        n = None
        for v, listed in zip(vals, self.listed):
            if listed:
                if n is not None and len(v) != n:
                    return None
                n = len(v)
        out = []
        for i in range(n or 0):
            pos: list = []
            kw: dict = {}
            for j, v in enumerate(vals):
                x = v[i] if self.listed[j] else v
                if self.positional[j]:
                    pos.append(x)
                else:
                    kw[self.kw_names[j]] = x
            out.append((pos, kw))
        return out


def split_of(func: Any) -> Split | None:
    """The per-tensor form of a functional foreach overload, or None (record it whole)."""
    name = func._schema.name.split("::")[1]
    if name not in _SPLIT:
        return None
    packet = getattr(aten, name[len("_foreach_") :], None)
    if packet is None:
        return None
    want = [_ELEM.get(str(a.type)) for a in func._schema.arguments]
    if None in want:
        return None
    for ov in packet.overloads():
        op = getattr(packet, ov)
        pargs = op._schema.arguments
        if ov.endswith("out") or any(a.alias_info is not None for a in pargs):
            continue
        if len(pargs) < len(want) or any(
            a.has_default_value() is False for a in pargs[len(want) :]
        ):
            continue
        if all(str(pargs[j].type) == w for j, w in enumerate(want)):
            return Split(func, op)
    return None


def record_split(s: Split, args: tuple, kwargs: dict, dispatch: Callable) -> list | None:
    """Record the foreach call as per-tensor ops (``dispatch(op, args, kwargs)`` records one);
    their results, or None when the call cannot be split."""
    calls = s.calls(args, kwargs)
    if calls is None:
        return None
    return [dispatch(s.op, tuple(pos), kw) for pos, kw in calls]
