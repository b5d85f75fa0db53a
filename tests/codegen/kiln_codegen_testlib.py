"""Helpers for the code generator tests: build small graphs, run them fused and through ATen."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from kiln.codegen.cpp import build
from kiln.ir.graph import Graph, GraphBuilder, Node, TensorType
from kiln.passes.fuse import fuse
from kiln.codegen.interpreter import Interpreter

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


def grads_of(fn, *xs):
    """``fn(*xs)`` and the gradients of its sum w.r.t. the floating-point inputs."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out = fn(*xs)
    gs = torch.autograd.grad(out.sum(), [x for x in xs if x.requires_grad])
    return out.detach(), gs


def check_compiled_vs_eager(fn, *xs):
    """``torch.compile(fn, backend="kiln")`` runs generated kernels (forward and backward graphs)
    and matches eager in value and gradients."""
    from kiln import metrics
    from kiln.config import config

    assert config.backend == "cpp"
    torch._dynamo.reset()
    eo, eg = grads_of(fn, *xs)
    before = metrics.get("fused_kernels")
    ko, kg = grads_of(torch.compile(fn, backend="kiln"), *xs)
    assert metrics.get("fused_kernels") > before, "no generated kernel ran"
    torch.testing.assert_close(ko, eo)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b)


def _poison(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.full(shape, -(2**62), dtype=dtype)


def poison_outputs(monkeypatch) -> None:
    """Every generated kernel's output buffer starts as NaN (ints: -2**62, bools: True), so a
    kernel that leaves an element unwritten fails the comparison instead of passing by luck."""
    from kiln.codegen.cpp import executor

    monkeypatch.setattr(executor, "new_output", _poison)
