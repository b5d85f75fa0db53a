"""torch.fx (ATen-level, from AOTAutograd) -> Kiln graph.

Placeholders become ``input`` nodes (tensors) or ``scalar`` nodes (SymInt / Python numbers), tensor
attributes (``get_attr``, constants lifted by Dynamo) become ``constant`` nodes, ATen
calls go through :func:`kiln.lowering.lower_call`, integer arithmetic on symbolic sizes becomes
``pyop`` nodes, AOTAutograd's random-number replay wrappers of an activation checkpoint's
region ``rng_saved`` / ``rng_replayed`` nodes (:mod:`kiln.frontends.compile.rng_replay`).  The
output spec says, per output position, which graph output fills it or which constant (``None``
for a gradient that does not exist).  ``copy_`` into a placeholder (an input mutation
AOTAutograd kept in the graph, e.g. an optimizer's parameter update) becomes a ``writeback`` node;
a source that aliases an input is cloned first, before any writeback, so that writebacks never
read a value another one has overwritten.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from kiln.frontends.compile import rng_replay, sdpa_no_draws
from kiln.ir.graph import Graph, GraphBuilder, In, Node
from kiln.ir.semantics import PYOPS, types_of, value_type
from kiln.lowering.aten import Ref, lower_call
from kiln.runtime.writebacks import Update, add_writebacks

aten = torch.ops.aten


def _as_to_copy(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    """``prims.convert_element_type(x, dtype)`` -> ``_to_copy(x, dtype=dtype)``."""
    if len(args) != 2 or kwargs:
        return None
    return aten._to_copy.default, args[:1], {"dtype": args[1]}


# Ops lowered as the ATen op that computes the same result, with its arguments:
# - ``lift_fresh_copy`` (how a tensor built from Python values inside the frame enters the graph,
#   e.g. T5's position buckets or a transformers ``DynamicCache``'s empty keys) is ATen's
#   ``clone`` of it; as an opaque node it ran through Python on every call, and ``dce`` kept it
#   when nothing read it;
# - ``prims.convert_element_type`` (left by torch's decompositions of number-to-tensor
#   conversions in graphs with symbolic sizes) is the dtype cast ``_to_copy`` (an ATen fallback
#   before 2026-12-05).
_AS: dict[Any, Callable[[tuple, dict], tuple[Any, tuple, dict] | None]] = {
    aten.lift_fresh_copy.default: lambda args, kwargs: (aten.clone.default, args, kwargs),
    torch.ops.prims.convert_element_type.default: _as_to_copy,
    # SDPA without dropout, untagged as random in a checkpointed region (sdpa_no_draws.py): ATen's
    # kernel with ``dropout_p=0``
    sdpa_no_draws.OP: sdpa_no_draws.as_aten,
}
_PYOP_NAMES = {v: k for k, v in PYOPS.items()}
_PYOP_NAMES.update({operator.mul: "mul", operator.add: "add", operator.sub: "sub"})
# torch's symbolic-number functions and the math functions Dynamo records on symbolic numbers
# (``x.size(1) ** 0.5`` traces ``sym_float``, ``int(n / 2)`` ``math.trunc``, ``math.sqrt(n)``
# ``torch._sym_sqrt``), computed as their builtins on the numbers the graph gets
_PYOP_NAMES.update(
    {
        torch.sym_float: "sym_float",
        torch.sym_int: "sym_int",
        torch.sym_max: "sym_max",
        torch.sym_min: "sym_min",
        torch.sym_not: "sym_not",
        torch._sym_sqrt: "sqrt",
    }
)


class UnsupportedGraph(Exception):
    pass


def _check_on_cpu(node: torch.fx.Node, val: Any) -> None:
    """Kiln generates CPU code: a graph holding a tensor on another device (cuda, meta, the kiln
    device itself) is not Kiln's to compile, and its kernels would read device memory as host memory.
    It runs as captured (ATen), counted as a fallback with this reason."""
    for v in torch.utils._pytree.tree_leaves(val):
        if isinstance(v, torch.Tensor) and v.device.type != "cpu":
            raise UnsupportedGraph(
                f"{node.name} is a tensor on {v.device}: Kiln compiles CPU tensors only"
            )


def fx_to_kiln(gm: torch.fx.GraphModule) -> tuple[Graph, list[tuple[str, Any]]]:
    b = GraphBuilder()
    env: dict[torch.fx.Node, int] = {}

    # getitem(rng_saved, 1) of an op with several values -> the Kiln node holding them after
    # the state (outputs 1, 2, ...)
    nested: dict[torch.fx.Node, int] = {}

    def ref_of(x: Any) -> Ref | None:
        if isinstance(x, torch.fx.Node):
            if x in nested:
                raise UnsupportedGraph(f"{x.name} (a random op's several outputs) used whole")
            return Ref(env[x])
        return None

    out_spec: list[tuple[str, Any]] = []
    outputs: list[int] = []
    pending: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # copy_(dst placeholder, src)
    updated: set[torch.fx.Node] = set()
    several: set[torch.fx.Node] = set()  # rng_saved wrappers of ops with several outputs
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        _check_on_cpu(node, val)
        if node.op == "placeholder":
            t = value_type(val)
            if t is None:
                raise UnsupportedGraph(f"placeholder {node.name} has no known type ({type(val)})")
            env[node] = b.input(t) if t.py is None else b.scalar(t.py)
        elif node.op == "call_function":
            tgt = node.target
            reads = [node.args[1]] if _is_input_copy(node) else node.all_input_nodes
            if updated and any(a in updated for a in reads):
                # writebacks run at the end: a read of an updated input would see its old value
                raise UnsupportedGraph(f"{node.name} reads a graph input after updating it")
            if tgt is operator.getitem and node.args[0] in nested:
                env[node] = b.getitem(nested[node.args[0]], 1 + node.args[1])
            elif tgt is operator.getitem and node.args[0] in several and node.args[1] == 1:
                nested[node] = env[node.args[0]]
            elif tgt is operator.getitem:
                env[node] = b.getitem(env[node.args[0]], node.args[1])
            elif _is_input_copy(node):
                pending.append((node.args[0], node.args[1]))
                updated.add(node.args[0])
                env[node] = env[node.args[1]]  # the value after the copy (types checked)
            elif isinstance(tgt, torch._ops.OpOverload):
                as_ = _AS.get(tgt)
                call = as_(node.args, dict(node.kwargs)) if as_ is not None else None
                func, args, kwargs = call or (tgt, node.args, dict(node.kwargs))
                n = lower_call(func, args, kwargs, ref_of, types_of(val, numbers_in_sequences=True))
                env[node] = b.add(n)
            elif tgt in rng_replay.WRAPPERS:
                try:
                    env[node], many = rng_replay.lower(node, b, env)
                except rng_replay.Unsupported as e:
                    raise UnsupportedGraph(str(e)) from e
                if many and tgt is rng_replay.run_and_save_rng_state:
                    several.add(node)
            elif tgt in _PYOP_NAMES:
                ins = tuple(env[a] for a in node.args if isinstance(a, torch.fx.Node))
                k = iter(range(len(ins)))
                targs = tuple(In(next(k)) if isinstance(a, torch.fx.Node) else a for a in node.args)
                env[node] = b.add(
                    Node(
                        f"pyop.{_PYOP_NAMES[tgt]}",
                        ins,
                        targs,
                        (),
                        types_of(val, numbers_in_sequences=True),
                    )
                )
            else:
                raise UnsupportedGraph(f"call to {tgt} is not an ATen op")
        elif node.op == "get_attr":  # a tensor constant lifted by Dynamo/AOTAutograd
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedGraph(f"get_attr {node.target} is not a tensor ({type(value)})")
            _check_on_cpu(node, value)
            env[node] = b.constant(value)
        elif node.op == "output":
            _writebacks(b, env, pending, gm)
            for o in node.args[0]:
                if o in nested:
                    raise UnsupportedGraph(
                        f"{o.name} (a random op's several outputs) returned whole"
                    )
                if isinstance(o, torch.fx.Node):
                    out_spec.append(("out", len(outputs)))
                    outputs.append(env[o])
                else:
                    out_spec.append(("const", o))
        else:
            raise UnsupportedGraph(f"fx node kind {node.op} ({node.target})")
    return b.build(outputs), out_spec


def _is_input_copy(node: torch.fx.Node) -> bool:
    if node.target is not torch.ops.aten.copy_.default or len(node.args) != 2 or node.kwargs:
        return False
    dst, src = node.args
    if not isinstance(dst, torch.fx.Node) or dst.op != "placeholder":
        return False
    if not isinstance(src, torch.fx.Node):
        return False
    d, s = dst.meta.get("val"), src.meta.get("val")
    # a broadcasting or casting copy keeps its ATen form (the copy's value is not the source's)
    return (
        isinstance(d, torch.Tensor)
        and isinstance(s, torch.Tensor)
        and d.shape == s.shape
        and d.dtype == s.dtype
    )


def _storage(v: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(v.untyped_storage())
    except Exception:  # noqa: BLE001 - no storage (e.g. a sparse value): assume it aliases
        return None


def _writebacks(b: GraphBuilder, env: dict, pending: list, gm: torch.fx.GraphModule) -> None:
    """Emit the collected input updates (sources that alias a graph input are cloned first)."""
    if not pending:
        return
    inputs = {
        _storage(p.meta["val"])
        for p in gm.graph.nodes
        if p.op == "placeholder" and isinstance(p.meta.get("val"), torch.Tensor)
    }
    updates = []
    for dst, src in pending:
        st = _storage(src.meta["val"])
        updates.append(Update(env[dst], env[src], fresh=st is not None and st not in inputs))
    add_writebacks(b, updates, clone_aliased=True)
