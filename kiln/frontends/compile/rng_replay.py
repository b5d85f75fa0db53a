"""AOTAutograd's random-number replay wrappers -> Kiln nodes.

In an activation checkpoint's region (``torch.utils.checkpoint``, ``transformers``'
``gradient_checkpointing_enable()``) the backward recomputes the region's forward, and its random
ops (dropout, SDPA with ``dropout_p > 0``) must draw what the forward drew.  The partitioner
wraps each such op: the forward calls ``run_and_save_rng_state(op, *args)`` (the generator's
state, then the op's result), the backward ``run_with_rng_state(state, op, *args)`` (the op run
again from that state, the generator restored after it).  Neither is an ATen op, and until
2026-12-05 a graph holding one ran whole on ATen (a counted ``graph:`` fallback).

Needs: an FX node of one of the two wrappers whose op is an ATen overload and whose inputs are
already in ``env``; the graph's fake mode (the backend call's) for the op's output types.
Guarantees: one ``rng_saved.<op>`` node with the flat outputs ``(state, *op outputs)`` or one
``rng_replayed.<op>`` node with the op's own outputs (records in :mod:`kiln.ir.ops`: random
category, never merged, dropped or moved); their numbers are the wrapped op's on the CPU
generator, as AOTAutograd's CPU implementations (``torch/_prims/rng_prims.py``) draw them.
``getitem(saved, 1)`` of an op with several outputs stands for the flat outputs after the
state, resolved by the ``getitem`` that reads it (:func:`kiln.frontends.compile.fx.fx_to_kiln`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from kiln.ir.graph import GraphBuilder, Node
from kiln.ir.semantics import types_of, value_type
from kiln.lowering.aten import Ref, template

WRAPPERS = (run_and_save_rng_state, run_with_rng_state)


class Unsupported(Exception):
    """A wrapper Kiln cannot lower (the graph then runs on ATen, counted)."""


def _op_output(op: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapped op's output on fake tensors (the FX inputs' ``val``), for its types."""

    def val(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            v = x.meta.get("val")
            if v is None:
                raise Unsupported(f"{x.name} has no value to type {op} with")
            return v
        return x

    fargs = torch.fx.node.map_aggregate(args, val)
    fkwargs = torch.fx.node.map_aggregate(kwargs, val)
    tensors = [v for v in (*fargs, *fkwargs.values()) if isinstance(v, torch.Tensor)]
    fake = torch._guards.detect_fake_mode(tensors)
    if fake is None:
        raise Unsupported(f"no fake mode to type {op} with")
    with fake:
        return op(*fargs, **fkwargs)


def lower(node: torch.fx.Node, b: GraphBuilder, env: dict[torch.fx.Node, int]) -> tuple[int, bool]:
    """One wrapper node -> one Kiln node: its id, and whether the op returns several values
    (then ``getitem(node, 1)`` of a saving wrapper stands for them, flat after the state)."""
    saved = node.target is run_and_save_rng_state
    state_arg: tuple = () if saved else (node.args[0],)
    op, *rest = node.args[0 if saved else 1 :]
    if not isinstance(op, torch._ops.OpOverload):
        raise Unsupported(f"{node.target} of {op} (not an ATen op)")
    kwargs = dict(node.kwargs)

    def ref_of(x: Any) -> Ref | None:
        if isinstance(x, torch.fx.Node):
            if x not in env:
                raise Unsupported(f"{node.name} reads {x.name}, which is not one value")
            return Ref(env[x])
        return None

    targs, tkwargs, inputs = template((*state_arg, *rest), kwargs, ref_of)
    out = _op_output(op, tuple(rest), kwargs)
    several = isinstance(out, (tuple, list))
    types = types_of(out, numbers_in_sequences=True)
    qual = f"{op._schema.name}.{op._overloadname}"
    if saved:
        types = (value_type(torch.get_rng_state()), *types)
    name = f"rng_saved.{qual}" if saved else f"rng_replayed.{qual}"
    return b.add(Node(name, inputs, targs, tkwargs, types)), several
