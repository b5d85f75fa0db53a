"""The optimization pipeline: one readable list of named Graph -> Graph steps.

Each step is timed (``KILN_LOG=passes``), can be switched off by name
(``KILN_DISABLE_PASSES=cse,fuse``), and its output is verified when ``KILN_CHECKS=1``.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from kiln.config import config
from kiln.ir.graph import Graph
from kiln.ir.verifier import verify

Pass = Callable[[Graph], Graph]


def _passes() -> list[tuple[str, Pass]]:
    # Imported here so each pass module stays independent of the pipeline.
    from kiln.passes.constant_fold import constant_fold
    from kiln.passes.cse import cse
    from kiln.passes.dce import dce
    from kiln.passes.layout import layout
    from kiln.passes.rotate import rotate
    from kiln.passes.simplify import simplify
    from kiln.passes.sink_permute import sink_permutes

    steps: list[tuple[str, Pass]] = [
        ("simplify", simplify),  # algebraic identities, view/permute chains, neutral copies
        ("layout", layout),  # copies feeding matmuls, reshape of contiguous copies
        ("rotate", rotate),  # RoPE's rotate_half (and its gradient) -> roll
        ("sink_permute", sink_permutes),  # elementwise ops computed in a permute's order
        ("constant_fold", constant_fold),  # small all-constant subgraphs
        ("cse", cse),  # duplicate computations
        ("dce", dce),  # whatever the steps above left unused
    ]
    return steps


# The generic passes; a backend adds its own after them (kiln.codegen.base.Backend.passes).
PIPELINE_NAMES: list[str] = [
    "simplify",
    "layout",
    "rotate",
    "sink_permute",
    "constant_fold",
    "cse",
    "dce",
]


def run_pipeline(
    g: Graph, trace: list | None = None, extra: Sequence[tuple[str, Pass]] = ()
) -> Graph:
    """Run every enabled pass in order, then the backend's ``extra`` passes; ``trace`` (if given)
    collects (name, seconds, graph)."""
    if config.checks:
        verify(g)
    for name, p in [*_passes(), *extra]:
        if name in config.disabled_passes:
            continue
        t0 = time.perf_counter()
        g = p(g)
        dt = time.perf_counter() - t0
        if config.checks:
            verify(g)
        if trace is not None:
            trace.append((name, dt, g))
        if config.log_enabled("passes"):
            print(f"[kiln] pass {name}: {dt * 1e3:.2f} ms, {len(g)} nodes")
    return g
