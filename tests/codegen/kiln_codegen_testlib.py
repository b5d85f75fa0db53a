"""Helpers for the code generator tests: build small graphs, run them fused and through ATen."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kiln.codegen.cpp import build
from kiln.ir.graph import Graph, GraphBuilder, Node, TensorType
from kiln.passes.fuse import fuse
from kiln.runtime.interpreter import Interpreter

F32 = torch.float32


def t(shape: Sequence, dtype: torch.dtype = F32) -> TensorType:
    return TensorType(tuple(shape), dtype)


def op(
    b: GraphBuilder, name: str, ins: Sequence[int], args: tuple, out: TensorType, **kwargs: Any
) -> int:
    return b.add(Node(name, tuple(ins), args, tuple(kwargs.items()), (out,)))


def run_both(g: Graph, inputs: list) -> tuple[list, list, dict]:
    """(eager results, kiln results, build info) for one graph."""
    fused = fuse(g)
    run, info = build(fused)
    expected = Interpreter(g)(inputs)
    got = run(inputs)
    return expected, got, info
