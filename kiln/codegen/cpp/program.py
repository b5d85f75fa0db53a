"""A graph as a program for the native launcher (``launcher.cpp``): one instruction per node.

Built once per graph, in Python, from the executor's steps; the launcher parses it once (operator
handles looked up, constants converted to IValues against the op's schema) and then runs it per
call without Python.  Instruction tuples are ``(kind, node, frees, ...)``:

  IN        input index
  CONST     the value
  KERNEL    function pointer, tensor-input slots, input modes, scalar slots, rank, static shape
            (or None), output kinds, output dtypes, output placements (-1 new buffer, -2 - n in
            place over node n, s >= 0 memory-plan slot s), single output?, the tensor inputs'
            dtypes (checked per call), flat? (KernelSpec.flat: full inputs sharing one dense
            layout are read as stored, the outputs made in that layout)
  ATEN      schema name, overload, one argument spec per schema argument, fallback op (a view's
            reshape) or None, unit last stride? (tensor arguments whose last stride is not 1 are
            copied first: the flash-attention kernels), the Python call and input nodes (used
            instead where the launcher cannot convert an argument), below autograd? (called with
            autograd's dispatch keys excluded: :func:`below_autograd`)
  GETITEM   source node, index
  WRITEBACK destination node, source node
  PYCALL    ``callable(list of input values)``, input nodes, take element 0?

Argument specs: ``(SLOT, node, to_double, to_tensor)``, ``(CONST,)`` (the schema default),
``(CONST, value)``, ``(WRAPPED, number)`` (a number where the schema has a Tensor),
``(TLIST, nodes)``, ``(OTLIST, nodes or -1)``, ``(ILIST, nodes or -1, constants)``.  A node whose
arguments have no such form (nested lists of other types, unknown ops, stochastic-rounding
kernels) becomes a PYCALL of the Python executor's own prepared call: same semantics, Python cost.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.codegen.cpp.aten_call import ARG_LAYOUT, has_in, prepared
from kiln.ir.graph import Graph, In, Node
from kiln.ir.kernel import OutKind
from kiln.ir.ops import Category, category
from kiln.ir.semantics import resolve

IN, CONST, KERNEL, ATEN, GETITEM, WRITEBACK, PYCALL = range(7)
SLOT, ACONST, TLIST, OTLIST, ILIST, WRAPPED = range(6)
_MODES = {"full": 0, "one": 1, "bcast": 2, "bcast_inner": 3}
_OUT = {
    OutKind.FULL: 0,
    OutKind.ROW: 1,
    OutKind.ROWK: 2,
    OutKind.COL: 3,
    OutKind.COLK: 4,
    OutKind.TRANS: 5,
}
_FLOAT_TYPES = ("float", "Optional[float]")
_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")
_INT_LISTS = ("List[int]", "Optional[List[int]]")


def _arg(v: Any, type_str: str, inp: Sequence[int]) -> tuple | None:
    """One argument's spec, or None where it has no native form."""
    if isinstance(v, In):
        return (SLOT, inp[v.k], type_str in _FLOAT_TYPES, type_str in _TENSOR_TYPES)
    if type_str in _TENSOR_TYPES and isinstance(v, (bool, int, float)):
        return (WRAPPED, v)  # a number where the op takes a tensor, as Python passes it
    if not has_in(v):
        return (ACONST, v)
    if not isinstance(v, (list, tuple)):
        return None
    if type_str == "List[Tensor]" and all(isinstance(x, In) for x in v):
        return (TLIST, [inp[x.k] for x in v])
    if type_str == "List[Optional[Tensor]]" and all(x is None or isinstance(x, In) for x in v):
        return (OTLIST, [-1 if x is None else inp[x.k] for x in v])
    if type_str in _INT_LISTS and all(isinstance(x, (In, int)) for x in v):
        nodes = [inp[x.k] if isinstance(x, In) else -1 for x in v]
        return (ILIST, nodes, [0 if isinstance(x, In) else int(x) for x in v])
    return None


def _overload(n: Node) -> torch._ops.OpOverload | None:
    """The ATen overload a node calls; None where its op is not one."""
    try:
        op = resolve(n.op)
    except (AttributeError, KeyError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) else None


def aten_instr(n: Node, inp: Sequence[int]) -> tuple | None:
    """``(schema name, overload, argument specs, fallback op)`` for an ATen node, or None."""
    if n.op.startswith("opaque."):
        # kept on the Python path: named profiler ranges, data-dependent results
        return None
    op = _overload(n)
    if op is None:
        return None
    schema = op._schema
    params = schema.arguments
    if len(n.args) > len(params):
        return None
    kw = dict(n.kwargs)
    specs: list[tuple] = []
    for p, a in enumerate(params):
        if p < len(n.args):
            if a.kwarg_only:
                return None
            v = n.args[p]
        elif a.name in kw:
            v = kw.pop(a.name)
        elif a.has_default_value():
            specs.append((ACONST,))
            continue
        else:
            return None
        spec = _arg(v, str(a.type), inp)
        if spec is None:
            return None
        specs.append(spec)
    if kw:
        return None
    fallback = "aten::reshape" if n.op == "view.default" else None
    # ops whose tensor arguments are copied to a safe layout first (aten_call.ARG_LAYOUT), in C++
    # as in the Python executor's wrapper
    return (schema.name, schema.overload_name, specs, fallback, ARG_LAYOUT.get(n.op, 0))


def _kernel_instr(x: Any, inp: Sequence[int], single: bool, slot_ids: dict) -> tuple | None:
    native = getattr(x, "kiln_native", None)
    if native is None:
        return None
    spec, fn, plan = native
    if spec.sr:
        return None  # a fresh random key per call: the Python call draws it
    static = spec.static_shape if all(isinstance(s, int) for s in spec.static_shape) else None
    placements = []
    for o in range(len(spec.out_kinds)):
        slot = plan[o] if plan is not None else None
        if slot is None:
            placements.append(-1)
        elif isinstance(slot, tuple):  # ("arg", q): in place over the node's input q
            placements.append(-2 - inp[slot[1]])
        else:
            placements.append(slot_ids.setdefault(slot, len(slot_ids)))
    return (
        ctypes.cast(fn, ctypes.c_void_p).value,
        [inp[k] for k in spec.tensor_inputs],
        [_MODES[m] for m in spec.input_modes],
        [inp[k] for k in spec.scalar_inputs],
        spec.rank,
        None if static is None else list(static),
        [_OUT[OutKind(k)] for k in spec.out_kinds],
        list(spec.out_dtypes),
        placements,
        single,
        list(spec.in_dtypes),
        spec.flat,
    )


def _aliases(n: Node) -> bool:
    """Whether the node's op may return an alias of an input (a view op, or one that can be)."""
    try:
        cat = category(n.op)
    except KeyError:
        cat = None
    if cat is Category.VIEW:
        return True
    op = _overload(n)
    if op is None:
        return True
    return op.is_view or any(r.alias_info is not None for r in op._schema.returns)


def _mutates(n: Node) -> bool:
    op = _overload(n)
    return op is None or op._schema.is_mutable


def _escaping(g: Graph) -> set[int]:
    """Nodes whose value the caller gets back, itself or through views: the graph's outputs and
    every value an output is a view (chain) of."""
    out: set[int] = set()
    todo = [o for o in g.outputs if isinstance(o, int)]
    while todo:
        i = todo.pop()
        if i in out:
            continue
        out.add(i)
        n = g.nodes[i]
        if n.inputs and n.op not in ("input", "scalar", "constant") and _aliases(n):
            todo.extend(n.inputs)
    return out


def below_autograd(n: Node, i: int, escaping: set[int]) -> bool:
    """Whether an ATen node may run with autograd's dispatch keys excluded (below
    ``ADInplaceOrView``, as inference mode runs ops): a graph runs with no gradient recording, so
    only what autograd keeps besides gradients matters.  An op that writes its inputs must bump
    their version counters, and a view the caller gets back (an output, or what an output is a
    view of) must be one that autograd knows as a view (a shared version counter, ``_base``):
    those run through autograd's keys.  Every other call skips them (a view op builds no view
    record, every op skips one dispatch layer: ~0.4 us a call inside a training step)."""
    if _mutates(n):
        return False
    return not (i in escaping and _aliases(n))


def build_program(g: Graph, steps: Sequence[tuple]) -> tuple[list[tuple], int]:
    """(instructions, number of memory-plan slots) for the executor's ``steps``:
    ``(kind, callable or value, input ids, freed ids)`` per node (see ``Executor``)."""
    prog: list[tuple] = []
    slot_ids: dict = {}
    escaping = _escaping(g)
    for i, (kind, x, inp, free) in enumerate(steps):
        n = g.nodes[i]
        head = (i, list(free))
        if kind == 0:
            prog.append((IN, *head, int(x)))
        elif kind == 1:
            prog.append((CONST, *head, x))
        elif n.op == "getitem":
            prog.append((GETITEM, *head, inp[0], int(n.args[1])))
        elif n.op == "writeback":
            prog.append((WRITEBACK, *head, inp[0], inp[1]))
        elif kind in (2, 3):
            k = _kernel_instr(x, inp, kind == 2, slot_ids)
            prog.append((KERNEL, *head, *k) if k else (PYCALL, *head, x, list(inp), kind == 2))
        else:
            a = aten_instr(n, inp)
            if a:
                below = below_autograd(n, i, escaping)
                prog.append((ATEN, *head, *a, _call(n), list(inp), below))
            else:
                prog.append((PYCALL, *head, _call(n), list(inp), False))
    return prog, len(slot_ids)


def _call(n: Node) -> Callable[[Sequence[Any]], Any]:
    return prepared(n)
