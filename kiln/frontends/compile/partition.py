"""The forward/backward partition of a joint graph: Inductor's min-cut partitioner (the backward
recomputes cheap values instead of saving them), never recomputing a read of an input the
forward mutates.

Needs: a joint graph from AOTAutograd (with its descriptors: ``InputMutationAOTOutput`` on the
output names an input whose mutation the epilogue applies; a ``copy_`` into a placeholder is one
kept in the graph).
Guarantees: every forward node that reads such an input -- directly or through views -- is
marked ``MUST_SAVE`` (saved where the backward needs it, never recomputed), and so are the
elements (``getitem``) of such a node's tuple of outputs, as a tuple itself is never saved;
nothing else changes.

Why: the mutation reaches the input in the forward (``copy_``) or right after it (the epilogue),
so a backward that recomputes ``1 + 1 / (n + 1)`` from a buffer ``n`` the forward incremented
reads the incremented buffer: a module that counts its calls in a buffer (``self.n.add_(1)``) and
scales its output by ``1 / n`` got gradients scaled by the next call's factor, in Inductor and
aot_eager too (torch 2.13; upstream: pytorch/pytorch#197039, open).  Marking the readers costs
nothing where the backward does not need them (batch norm's running statistics)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch.fx
from functorch.compile import default_partition, min_cut_rematerialization_partition
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
from torch.utils.checkpoint import CheckpointPolicy

from kiln.frontends.compile.constant_recompute import mark_constant_values
from kiln.frontends.compile.joint_cse import joint_cse
from kiln.frontends.compile.sdpa_no_draws import untag_draw_free_sdpa


def _mutated_inputs(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Inputs whose data the forward mutates: written back in the graph (``copy_`` into the
    placeholder: AOTAutograd keeps mutations of inputs that need no gradient there) or returned
    for the epilogue to write (``InputMutationAOTOutput``)."""
    out = next(iter(graph.find_nodes(op="output")))
    returned = {
        d.mutated_input for d in out.meta.get("desc") or () if isinstance(d, InputMutationAOTOutput)
    }
    written = {
        n.args[0]
        for n in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
        if isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"
    }
    return [
        n
        for n in graph.find_nodes(op="placeholder")
        if n in written or n.meta.get("desc") in returned
    ]


def _is_view(node: torch.fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.is_view


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes that depend on a tangent (the backward's; they cannot be saved)."""
    out: set[torch.fx.Node] = set()
    for node in graph.nodes:  # topological order
        if (node.op == "placeholder" and "tangents" in node.name) or any(
            a in out for a in node.all_input_nodes
        ):
            out.add(node)
    return out


def keep_reads_of_mutated_inputs(graph: torch.fx.Graph) -> int:
    """Mark the forward readers of mutated inputs ``MUST_SAVE``; returns how many."""
    mutated = _mutated_inputs(graph)
    if not mutated:
        return 0
    backward = _backward_nodes(graph)
    marked = 0
    for inp in mutated:
        todo, seen = list(inp.users), set()
        while todo:
            node = todo.pop()
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if _is_view(node):
                todo.extend(node.users)  # a view reads when its consumer does
            elif node.target is not torch.ops.aten.copy_.default and node not in backward:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                marked += 1
                if isinstance(node.meta.get("val"), (tuple, list)):
                    # a tuple is not saved, its elements are: they must be saved too, or a
                    # checkpointed region's policy (recompute) contradicts this one (batch norm
                    # in training reads its running statistics)
                    for user in node.users:
                        if user.target is operator.getitem and user not in backward:
                            user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                            marked += 1
    return marked


def min_cut_keeping_mutated_reads(
    joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """:func:`min_cut_rematerialization_partition` after :func:`keep_reads_of_mutated_inputs`,
    with Kiln's CSE of the joint graph in place of the partitioner's own (which imports
    Inductor's lowering: :mod:`kiln.frontends.compile.joint_cse`), values computed from no input
    recomputed (:mod:`kiln.frontends.compile.constant_recompute`), checkpointed attention without
    dropout recomputed without random-state replay (:mod:`kiln.frontends.compile.sdpa_no_draws`)."""
    keep_reads_of_mutated_inputs(joint.graph)
    untag_draw_free_sdpa(joint.graph)
    if functorch_config.cse:
        joint_cse(joint.graph)
    mark_constant_values(joint.graph)  # recomputed and folded in both graphs, never saved
    with functorch_config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kw)


def saving_all_but_checkpointed(
    joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's :func:`default_partition` (``KILN_RECOMPUTE=0``: the forward saves what the
    backward reads, a checkpointed region's values aside), checkpointed attention without dropout
    recomputed without random-state replay (:mod:`kiln.frontends.compile.sdpa_no_draws`)."""
    untag_draw_free_sdpa(joint.graph)
    return default_partition(joint, joint_inputs, **kw)
