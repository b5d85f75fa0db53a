"""Run a graph-level rewrite of the compile frontend on the graph Dynamo captures of a function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def rewritten(rewrite: Callable[[torch.fx.GraphModule], Any], fn: Callable, *args: Any) -> dict:
    """``fn`` captured by Dynamo and ``rewrite`` applied to its graph: ``n`` (what the rewrite
    returned), ``meta`` (every node it added carries Dynamo's ``example_value``: AOTAutograd's
    cache bypasses graphs whose tensors lack it) and ``ops`` (the call targets' names after)."""
    seen: dict = {}

    def backend(gm, example_inputs):
        before = set(gm.graph.nodes)
        seen["n"] = rewrite(gm)
        seen["meta"] = all("example_value" in n.meta for n in gm.graph.nodes if n not in before)
        seen["ops"] = [
            getattr(n.target, "__name__", str(n.target))
            for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")
        ]
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return seen
