"""Helpers for the code generator tests: build small graphs, run them fused and through ATen."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import pytest
import torch

from kiln.codegen.cpp import build
from kiln.config import config
from kiln.ir.graph import Graph, GraphBuilder, Node, TensorType
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.codegen.interpreter import Interpreter

F32 = torch.float32

# A test of the C++ backend's own kernels (their accuracy, what they refuse): it says nothing about
# another backend, so it is skipped when KILN_BACKEND selects one (tests/conftest.py).
cpp_only = pytest.mark.needs_backend("cpp", reason="checks the C++ backend's generated kernels")


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


@contextmanager
def on_configured_backend(min_graphs: int = 1) -> Iterator[None]:
    """The block ran at least ``min_graphs`` Kiln graphs, all through the configured backend
    (``KILN_BACKEND``); with the C++ backend, generated kernels ran."""
    from kiln.runtime.compiler import executables

    runs = {id(e): e.runs for e in executables()}
    yield
    ran = [e for e in executables() if e.runs > runs.get(id(e), 0)]
    assert len(ran) >= min_graphs, f"{len(ran)} Kiln graphs ran, expected {min_graphs}"
    assert {e.info["backend"] for e in ran} == {config.backend}
    if config.backend == "cpp":  # (a graph compiled now, or a shape-generic one from before)
        assert any(e.info.get("kernels") for e in ran), "no generated kernel ran"


def check_compiled_vs_eager(fn, *xs):
    """``torch.compile(fn, backend="kiln")`` matches eager in value and gradients, and its forward
    and backward graphs ran through the configured backend (with cpp: generated kernels)."""
    torch._dynamo.reset()
    eo, eg = grads_of(fn, *xs)
    with on_configured_backend(min_graphs=2):
        ko, kg = grads_of(torch.compile(fn, backend="kiln"), *xs)
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
