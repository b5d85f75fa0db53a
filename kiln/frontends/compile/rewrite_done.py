"""The end every rewrite of Dynamo's FX graph shares (dropout, gqa, attention, short_attention)."""

from __future__ import annotations

import torch.fx

from kiln import metrics


def finish(gm: torch.fx.GraphModule, found: int, counter: str) -> int:
    """After ``found`` rewrites of ``gm`` in place: check the graph, regenerate its code and count
    them under ``counter``; returns ``found``."""
    if found:
        gm.graph.lint()
        gm.recompile()
        metrics.incr(counter, found)
    return found
