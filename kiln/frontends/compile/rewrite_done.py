"""What every rewrite of Dynamo's FX graph shares (dropout, gqa, attention, short_attention,
strided_matmul): the context new nodes' example values are computed in, and the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from kiln import metrics


@contextlib.contextmanager
def example_values(fake_mode: Any) -> Iterator[None]:
    """Where a rewrite computes a new node's example value: in Dynamo's fake mode (if any), under
    identity saved-tensor hooks over the caller's.  Autograd saves the fake operands of a
    differentiable op, and a user's ``saved_tensors_hooks`` must not see them: a memory probe
    counted them as saved tensors, and one that reads storages raised on them (the rewrite then
    fell back)."""
    fake = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with fake, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


def finish(gm: torch.fx.GraphModule, found: int, counter: str) -> int:
    """After ``found`` rewrites of ``gm`` in place: check the graph, regenerate its code and count
    them under ``counter``; returns ``found``."""
    if found:
        gm.graph.lint()
        gm.recompile()
        metrics.incr(counter, found)
    return found
