"""Golden checks for the code generation passes (fuse, memory_plan): their output holds ``fused``
nodes, which only the C++ backend runs, so results are compared through it."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import torch
from _passes_testlib import example_inputs

from kiln.codegen.cpp import build
from kiln.ir import Graph, verify
from kiln.codegen.interpreter import Interpreter


def check_codegen_pass(
    p: Callable[[Graph], Graph], g: Graph, expected: str, ref: Graph | None = None
) -> Graph:
    """Pass ``p`` on ``g``: the result verifies, prints as ``expected``, and the C++ backend
    running it gives what the reference interpreter gives for ``ref`` (default ``g``; the graph
    before fusion when ``g`` already holds fused nodes), twice: slot buffers persist."""
    verify(g)
    out = p(g)
    verify(out)
    assert str(out) == textwrap.dedent(expected).strip(), "\n" + str(out)
    run, _ = build(out)
    for seed in (0, 1):
        want = Interpreter(ref or g)(example_inputs(g, seed))
        got = run(example_inputs(g, seed))
        for w, o in zip(want, got):
            # the interpreter's ATen ops against the kernels' formulas (exp: eager's vectorized
            # exp, where the interpreter's torch.exp is MKL's), through GEMMs: a misplaced buffer
            # is off by O(1), a last-bit difference by ~1e-6
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
    return out
