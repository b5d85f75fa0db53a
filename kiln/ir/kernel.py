"""The fused-kernel contract: what fusion produces and every backend consumes.

A ``fused`` node carries its kernel as keyword attributes (so graphs stay plain, hashable,
printable and picklable); :class:`FusedKernel` is the typed view of them::

    k = FusedKernel.of(node)     # kind, shape, body, outputs, members, strided, placement
    node = Node("fused", inputs, (), k.to_kwargs(), types)

The enums are ``str`` enums whose ``repr`` is the plain string, so printouts and structural hashes
read as before; body references are :class:`Val` (another body entry) and :class:`Lit` (an inlined
constant), recognised by type, never by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from kiln.ir.node import Node


class _ReprStr(str, enum.Enum):
    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return self.value


class LoopKind(_ReprStr):
    """The loop nest of a fused kernel."""

    POINTWISE = "pointwise"  # one loop over the iteration shape
    ROWS = "rows"  # pointwise prologue, then reductions over the last dim
    COLS = "cols"  # pointwise prologue, then sums over the leading dims


class OutKind(_ReprStr):
    """The shape of one kernel output relative to the iteration shape ``s``."""

    FULL = "full"  # s
    ROW = "row"  # s[:-1]
    ROWK = "rowk"  # s[:-1] + (1,)   (keepdim)
    COL = "col"  # s[-1:]
    COLK = "colk"  # (1,) * (len(s) - 1) + s[-1:]   (keepdim)
    TRANS = "trans"  # s[:-2] + (s[-1], s[-2])   (the last two dims swapped: a transposed copy)

    def shape(self, s: tuple) -> tuple:
        if self is OutKind.FULL:
            return s
        if self is OutKind.ROW:
            return s[:-1]
        if self is OutKind.ROWK:
            return s[:-1] + (1,)
        if self is OutKind.TRANS:
            return s[:-2] + (s[-1], s[-2])
        if self is OutKind.COL:
            return s[-1:]
        return (1,) * (len(s) - 1) + s[-1:]


@dataclass(frozen=True)
class Val:
    """Body reference to the value of body entry ``i``."""

    i: int

    def __repr__(self) -> str:
        return f"Val({self.i})"


@dataclass(frozen=True)
class Lit:
    """An inlined one-element constant tensor (value and dtype abbreviation)."""

    value: Any
    dtype: str

    def __repr__(self) -> str:
        return f"Lit({self.value!r},{self.dtype})"


class BodyOp(NamedTuple):
    """One member of the kernel: an op call whose arguments are In(k) / Val(i) / Lit / constants."""

    op: str
    args: tuple
    kwargs: tuple
    dtype: str  # dtype abbreviation of its result ("f32")

    def __repr__(self) -> str:
        return repr(tuple(self))


class InPlace(NamedTuple):
    """Placement of an output written into the buffer of the node's input ``input`` (an in-place
    update of a graph input); reads as the tuple ``("arg", input)``."""

    tag: str
    input: int

    def __repr__(self) -> str:
        return repr(tuple(self))


def in_place(q: int) -> InPlace:
    return InPlace("arg", q)


# Per output: None (a fresh buffer), a slot number (a buffer kept by the executable and reused
# between dead values), or InPlace (written into one of the node's inputs).
Placement = int | InPlace | None


@dataclass(frozen=True)
class FusedKernel:
    kind: LoopKind
    shape: tuple  # iteration shape (symbolic sizes allowed)
    body: tuple[BodyOp, ...]
    outputs: tuple[int, ...]  # body entries the node returns, in order
    members: tuple[int, ...] = ()  # ids of the fused nodes in the input graph (kiln explain)
    strided: tuple[int, ...] = ()  # inputs read through their strides
    placement: tuple[Placement, ...] | None = None  # set by memory planning

    @staticmethod
    def of(node: Node) -> FusedKernel:
        kw = dict(node.kwargs)
        placement = kw.get("placement")
        return FusedKernel(
            LoopKind(kw["kind"]),
            tuple(kw["shape"]),
            tuple(BodyOp(*b) for b in kw["body"]),
            tuple(kw["outputs"]),
            tuple(kw.get("members", ())),
            tuple(kw.get("strided") or ()),
            None
            if placement is None
            else tuple(in_place(p[1]) if isinstance(p, tuple) else p for p in placement),
        )

    def to_kwargs(self) -> tuple[tuple[str, Any], ...]:
        kw: tuple[tuple[str, Any], ...] = (
            ("kind", self.kind),
            ("shape", tuple(self.shape)),
            ("body", tuple(self.body)),
            ("outputs", tuple(self.outputs)),
            ("members", tuple(self.members)),
        )
        if self.strided:
            kw += (("strided", tuple(self.strided)),)
        if self.placement is not None:
            kw += (("placement", tuple(self.placement)),)
        return kw
