"""Common subexpressions of AOTAutograd's joint graph merged before the min-cut partition.

torch's min-cut partitioner starts with a CSE of the joint graph (``fx_graph_cse``, on by
``torch._functorch.config.cse``), so that a value the forward and the backward both compute (a
weight's transpose, a mask) is one node the partition can save or recompute once.  That function
imports ``torch._inductor.pattern_matcher`` for two small helpers, and with it Inductor's
lowering and code generators: 0.5-0.6 s of CPU in the first compile of every process (a cold
tiny GPT step 3.9-4.0 -> 3.2-3.4 s of CPU without it, 1 thread, 2026-12-03).  Kiln merges the
same duplicates itself and runs the partitioner with that option off
(:func:`kiln.frontends.compile.partition.min_cut_keeping_mutated_reads`).

Needs: a joint graph whose nodes carry ``meta["val"]`` (AOTAutograd's).
Guarantees: a ``call_function`` node that computes what an earlier node computes -- the same op,
the same arguments (earlier duplicates already replaced; numbers compared with their types and
zeros with their signs), no in-place op between the two -- is replaced by the earlier node and
erased.  Never merged: ops that mutate (their schema says so, or an ``out=`` argument; each one
also ends the span in which nodes may merge), random ops (``nondeterministic_seeded``), ``empty`` and its kin (uninitialized
memory), nodes whose storage a graph output shares (eager returns separate tensors for them),
nodes whose value is an unbacked symbol, and calls that are neither an ATen op nor ``getitem``
(higher-order ops and other callables: what they do is not read here).  Returns how many nodes
it erased.  Rewrites: the graph in place (its users re-pointed, the duplicates erased).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

# ops whose result is uninitialized memory: two of them are two buffers, never one value
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _storage(node: torch.fx.Node) -> StorageWeakRef | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except NotImplementedError:
        return None


def _plain_python(target: Any) -> bool:
    """``operator.*``, ``math.*`` and ``torch.sym_*`` calls on sizes: pure, never merged."""
    module = getattr(target, "__module__", None)
    return module in ("_operator", "operator", "math") or getattr(
        target, "__name__", ""
    ).startswith("sym_")


def _mutates(node: torch.fx.Node) -> bool:
    """An in-place op, or a call this pass does not read (a higher-order op, any other callable):
    the span in which nodes may merge ends there."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable or "out" in node.kwargs
    return not (t is operator.getitem or _plain_python(t))


def _mergeable(node: torch.fx.Node) -> bool:
    t = node.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in t.tags or t.overloadpacket.__name__ in _EMPTY:
        return False
    val = node.meta.get("val")
    return not (isinstance(val, torch.SymInt) and free_unbacked_symbols(val))


def _key(node: torch.fx.Node) -> Any:
    """The node's op and arguments (node arguments already re-pointed at the duplicates' first
    occurrences); None when an argument is not hashable."""
    flat = []
    for part in (node.args, node.kwargs):
        leaves, spec = tree_flatten(part)
        vals = []
        for v in leaves:
            if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                v = v.node
            elif isinstance(v, float):
                # 0.0 == -0.0, but x * 0.0 and x * -0.0 differ in the sign of their zeros
                vals.append((v, float, math.copysign(1.0, v)))
                continue
            vals.append((v, type(v)))
        flat.append((tuple(vals), str(spec)))
    key = (node.target, tuple(flat))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def joint_cse(graph: torch.fx.Graph) -> int:
    """Merge the joint graph's duplicate nodes in place (see the module docstring); how many."""
    output = next(iter(graph.find_nodes(op="output")))
    out_storages = {s for s in map(_storage, output.all_input_nodes) if s is not None}
    seen: dict[Any, torch.fx.Node] = {}
    erased = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _mutates(node):
            seen.clear()  # nothing before an in-place op stands for what comes after it
            continue
        if not _mergeable(node) or _storage(node) in out_storages:
            continue
        key = _key(node)
        if key is None:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(first)  # later users now name the first occurrence
        graph.erase_node(node)
        erased += 1
    return erased
