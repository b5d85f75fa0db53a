"""Graphs whose outputs belong to separate autograd graphs (a GAN step's generator output and
discriminator loss): compiled one AOTAutograd function per part.

Needs: a Dynamo graph with ``example_value`` metadata (fake tensors whose ``requires_grad`` says
what autograd records).  Guarantees: :func:`separate_autograd_parts` counts and
:func:`detached_across_parts` answers without changing anything; :func:`split_by_parts` returns
a new split module (or None) and leaves ``gm`` as it is; :class:`PartsRunner` computes what
``gm`` computes, each part an autograd node of its own.

Why: AOTAutograd makes one autograd node of a whole graph.  In eager PyTorch, a GAN step's
``fake = G(z)`` and the discriminator loss on ``fake.detach()`` are separate autograd graphs:
``loss_d.backward()`` leaves the generator's graph alone, and ``D(fake)``'s loss backpropagates
through it afterwards.  Compiled as one node, ``loss_d.backward()`` runs (and frees) that node's
backward, and the generator's backward then raises "Trying to backward through the graph a
second time" -- with every AOTAutograd backend (Inductor, aot_eager), on PyTorch's DCGAN recipe.
Kiln splits such a graph by part (as Dynamo's DDP optimizer splits graphs at bucket boundaries)
and compiles each piece at the first call, with that call's tensors; where the parts interleave
(an earlier part computed from a later one) or the graph has symbolic sizes or calls kept for
their effect, it runs as Dynamo captured it (eager autograd, counted as an ATen fallback).

Two values are in one autograd part when one is computed from the other and both require grad
(``detach``, ``no_grad`` regions and integer results cut the chain).  The case above is a graph
with two or more parts that each give an output requiring grad, one reaching another through a
cut (:func:`detached_across_parts`); parts with no such link (two encoders whose joint loss is
taken after a graph break) stay compiled as one, their single ``backward()`` being right there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_requires_grad(v) for v in value)
    return False


def _parts(gm: torch.fx.GraphModule) -> tuple[set[torch.fx.Node], Callable, set[torch.fx.Node]]:
    """(nodes whose values require grad, their part's representative, the representatives of the
    parts that give an output requiring grad)."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent.get(n, n) is not n:
            parent[n] = parent.get(parent[n], parent[n])
            n = parent[n]
        return n

    grad = {n for n in gm.graph.nodes if _requires_grad(n.meta.get("example_value"))}
    for n in gm.graph.nodes:
        if n not in grad or n.op == "output":
            continue
        for u in n.all_input_nodes:
            if u in grad:
                parent[find(u)] = find(n)
    out = next(iter(gm.graph.find_nodes(op="output")))
    return grad, find, {find(u) for u in out.all_input_nodes if u in grad}


def separate_autograd_parts(gm: torch.fx.GraphModule) -> int:
    """How many separate autograd parts of ``gm`` give an output that requires grad."""
    return len(_parts(gm)[2])


def detached_across_parts(gm: torch.fx.GraphModule) -> bool:
    """Whether a value of one part with an output requiring grad reaches another such part
    through a cut (``detach``, a ``no_grad`` computation): the GAN step's ``D(fake.detach())``.

    Parts with no such link (two encoders whose outputs leave the graph before the loss that
    joins them) are left compiled as one: their usual single ``backward()`` is right there."""
    grad, find, outs = _parts(gm)
    if len(outs) < 2:
        return False
    reached: dict[torch.fx.Node, set[torch.fx.Node]] = {}  # non-grad node -> parts cut into it
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        came: set[torch.fx.Node] = set()
        for u in n.all_input_nodes:
            came |= {find(u)} if u in grad else reached.get(u, set())
        if n not in grad:
            reached[n] = came
        elif find(n) in outs and any(p in outs and p is not find(n) for p in came):
            return True
    return False


def split_by_parts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """``gm`` split into submodules (``submod_<i>``, each returning a tuple) so that no two parts
    with outputs requiring grad share one; None where that cannot be done in order: a node of an
    earlier part computed from a later one, a symbolic size, or a call kept for its effect (a
    ``set_grad_enabled``, an autocast switch: splitting would move it across the others).

    Each node goes to the partition of its part (ranked by first appearance) or, if later, of its
    latest input, so partitions only read earlier ones."""
    grad, find, outs = _parts(gm)
    rank: dict[torch.fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n in grad and find(n) in outs and find(n) not in rank:
            rank[find(n)] = len(rank)
    pid: dict[torch.fx.Node, int] = {}
    owner: dict[int, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if not isinstance(n.meta.get("example_value"), torch.Tensor):
                return None  # a SymInt or other non-tensor input: sizes may change
            continue
        if n.op in ("output", "get_attr"):
            continue
        if not n.users:
            return None  # called for its effect on global state
        p = max(
            [rank.get(find(n), 0) if n in grad else 0] + [pid.get(u, 0) for u in n.all_input_nodes]
        )
        if n in grad and find(n) in outs and owner.setdefault(p, find(n)) is not find(n):
            return None
        pid[n] = p
    if len(set(pid.values())) < 2:
        return None
    from torch.fx.passes.split_module import split_module

    return split_module(gm, None, lambda n: pid[n], keep_original_order=True, tuple_return=True)


class PartsRunner:
    """Runs a :func:`split_by_parts` module, each submodule compiled by ``compile_part`` (one
    AOTAutograd function each) at the first call, with that call's tensors as example inputs:
    the first call runs the parts as they are compiled, later calls the compiled parts."""

    def __init__(self, split: torch.fx.GraphModule, compile_part: Callable) -> None:
        self.split = split
        self.compile_part = compile_part
        self.ready = False

    def __call__(self, *args: Any) -> Any:
        if self.ready:
            return self.split(*args)
        out = _CompileParts(self.split, self.compile_part).run(*args)
        self.split.recompile()
        self.ready = True
        return out


class _Compiled(torch.nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> tuple:
        return tuple(self.fn(*args))


class _CompileParts(torch.fx.Interpreter):
    def __init__(self, split: torch.fx.GraphModule, compile_part: Callable) -> None:
        super().__init__(split)
        self.compile_part = compile_part

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        compiled = _Compiled(self.compile_part(sub, list(args)))
        setattr(self.module, target, compiled)
        return compiled(*args, **kwargs)
