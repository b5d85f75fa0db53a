"""Values a joint graph computes from no input at all are recomputed by the backward, never saved.

A ``transformers`` model without an ``attention_mask`` builds its causal mask from ``ones``,
``arange``, ``cumsum``, ``index`` and comparisons: values that depend only on shapes.  The
min-cut partitioner saves some of them for the backward (Llama: the ``cumsum`` and two
``index`` results), so the forward returns them and the backward rebuilds the mask from graph
inputs.  Kiln's constant folding (:mod:`kiln.passes.constant_fold`) cannot fold a chain that
starts at a graph input, so both graphs ran the mask's ~10 ATen calls every step.  Recomputed
instead, each graph starts the chain from factory calls, which fold to one stored constant.

Needs: a joint graph from AOTAutograd whose nodes carry ``meta["val"]``.
Guarantees: a ``call_function`` node is marked ``MUST_RECOMPUTE`` when it is an ATen op that is
neither random (``nondeterministic_seeded``), uninitialised memory (``empty*``) nor mutating, every
node it reads is such a node (or a ``get_attr`` constant), no placeholder is among its ancestors,
and its value is a tensor with static sizes of at most ``MAX_BYTES`` (what constant folding takes):
so the partitioner never saves it and Kiln folds it in both graphs.  Nothing else changes.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from kiln.passes.constant_fold import MAX_BYTES

_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _pure_aten(node: torch.fx.Node) -> bool:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or t.namespace not in ("aten", "prims"):
        return False
    if t.is_view:
        return True
    s = t._schema
    if s.is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    return t._opname not in _EMPTY


def _small_static(node: torch.fx.Node) -> bool:
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return False
    if not all(isinstance(s, int) for s in v.shape):
        return False
    return v.numel() * v.element_size() <= MAX_BYTES


def mark_constant_values(graph: torch.fx.Graph) -> int:
    """Mark every node computed from constants alone ``MUST_RECOMPUTE``; returns how many."""
    constant: set[torch.fx.Node] = set()
    marked = 0
    for node in graph.nodes:  # topological order
        if node.op == "get_attr":
            constant.add(node)
            continue
        if node.op != "call_function" or not _pure_aten(node):
            continue
        if not all(a in constant for a in node.all_input_nodes):
            continue
        if not _small_static(node):
            continue
        constant.add(node)
        if "recompute" not in node.meta:  # a user's checkpoint policy stays
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked += 1
    return marked
