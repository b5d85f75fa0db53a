"""The values of a graph: argument markers, tensor types and (immutable) nodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir.ops import Category, category


@dataclass(frozen=True)
class In:
    """Placeholder in an argument template for the node's ``k``-th input."""

    k: int

    def __repr__(self) -> str:
        return f"In({self.k})"


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of one value.  A ``scalar`` node's type has ``shape=()`` and a Python dtype
    name in ``py`` ("float", "int", "bool")."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    py: str | None = None

    def __str__(self) -> str:
        if self.py is not None:
            return self.py
        return f"{dtype_abbr(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


_ABBR = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_abbr(dt: torch.dtype | None) -> str:
    if dt is None:
        return "?"
    return _ABBR.get(dt, str(dt).replace("torch.", ""))


@dataclass(frozen=True)
class Node:
    op: str  # Kiln op, e.g. "add.Tensor"; "opaque" nodes name their ATen op in attr "target"
    inputs: tuple[int, ...] = ()
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    types: tuple[TensorType | None, ...] = ()  # one per output; None for non-tensor outputs

    @property
    def category(self) -> Category:
        return category(self.op)

    @property
    def type(self) -> TensorType | None:
        return self.types[0] if len(self.types) == 1 else None

    def kwarg(self, name: str, default: Any = None) -> Any:
        for k, v in self.kwargs:
            if k == name:
                return v
        return default

    def with_(self, **changes: Any) -> "Node":
        d = dict(
            op=self.op, inputs=self.inputs, args=self.args, kwargs=self.kwargs, types=self.types
        )
        d.update(changes)
        return Node(**d)
