"""Runs an optimized graph: fused nodes call generated kernels, all others go through ATen.

The executor is prepared once per graph (a list of steps with everything the hot loop needs bound
in closures) and run many times.  Values are dropped right after their last use.  When the graph
carries a memory plan (``kiln.passes.memory_plan``), fused outputs are written into slot buffers
kept for the life of the executable (reused between dead values, and in place over a dying input)
instead of fresh ones.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Sequence

import torch

from kiln.codegen.cpp.emit import KernelSpec
from kiln.ir.graph import Graph
from kiln.runtime.interpreter import call_node, last_uses

_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double


def _out_shape(kind: str, s: tuple) -> tuple:
    if kind == "full":
        return s
    if kind == "row":
        return s[:-1]
    if kind == "rowk":
        return s[:-1] + (1,)
    if kind == "col":
        return s[-1:]
    return (1,) * (len(s) - 1) + s[-1:]


def make_fused_call(spec: KernelSpec, fn: Any, plan: tuple | None, slots: dict) -> Callable:
    """A callable ``(input values) -> output tensors`` for one fused node."""
    tin = spec.tensor_inputs
    modes = spec.input_modes
    sins = spec.scalar_inputs
    R = spec.rank
    n_p = len(tin) + len(spec.out_kinds)
    PA = _P * n_p
    static = spec.static_shape if all(isinstance(s, int) for s in spec.static_shape) else None
    anchor = next((p for p, m in enumerate(modes) if m == "full"), None)
    bcast = [p for p, m in enumerate(modes) if m in ("bcast", "bcast_inner")]
    n_i = R + R * len(bcast)
    IA = _I * max(n_i, 1)
    DA = _D * max(len(sins), 1)
    outs = list(zip(spec.out_kinds, spec.out_dtypes))
    out_plan = plan or tuple(None for _ in outs)

    def call(ins: Sequence[Any]) -> list[torch.Tensor]:
        ts = [ins[k] for k in tin]
        for p, m in enumerate(modes):
            t = ts[p]
            if m == "full":
                if not t.is_contiguous():
                    ts[p] = t.contiguous()
            elif m == "bcast_inner" and t.stride(-1) != 1 and t.shape[-1] != 1:
                ts[p] = t.contiguous()
        if anchor is not None:
            shape = tuple(ts[anchor].shape)
        elif static is not None:
            shape = static
        else:
            shape = tuple(torch.broadcast_shapes(*(t.shape for t in ts)))
        ints = list(shape)
        for p in bcast:
            t = ts[p]
            off = R - t.dim()
            for d in range(R):
                di = d - off
                ints.append(0 if di < 0 or t.shape[di] == 1 else t.stride(di))
        results = []
        for o, (kind, dt) in enumerate(outs):
            osh = _out_shape(kind, shape)
            slot = out_plan[o]
            if slot is None:
                buf = torch.empty(osh, dtype=dt)
            else:
                buf = slots.get(slot)
                if buf is None or buf.shape != osh or buf.dtype != dt:
                    buf = torch.empty(osh, dtype=dt)
                    slots[slot] = buf
            results.append(buf)
        ptrs = PA(*[t.data_ptr() for t in ts], *[t.data_ptr() for t in results])
        fn(ptrs, IA(*ints), DA(*[float(ins[k]) for k in sins]))
        return results

    return call


class Executor:
    """A graph with its kernels, prepared once, run many times."""

    def __init__(self, g: Graph, calls: dict[int, Callable]) -> None:
        self.graph = g
        self.free = last_uses(g)
        self._lock = threading.Lock()
        steps = []
        for i, n in enumerate(g.nodes):
            if n.op in ("input", "scalar"):
                steps.append((0, n.kwarg("index"), n))
            elif n.op == "constant":
                steps.append((1, g.constants[n.kwarg("index")], n))
            elif i in calls:
                steps.append((2 if len(n.types) == 1 else 3, calls[i], n))
            else:
                steps.append((4, None, n))
        self.steps = steps

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        with self._lock:  # slot buffers are shared between runs of this executable
            return self._run(inputs)

    def _run(self, inputs: Sequence[Any]) -> list[Any]:
        g = self.graph
        vals: list[Any] = [None] * len(g.nodes)
        free = self.free
        for i, (kind, x, n) in enumerate(self.steps):
            if kind == 0:
                vals[i] = inputs[x]
            elif kind == 1:
                vals[i] = x
            else:
                ins = [vals[j] for j in n.inputs]
                if kind == 2:
                    vals[i] = x(ins)[0]
                elif kind == 3:
                    vals[i] = x(ins)
                else:
                    vals[i] = call_node(n, ins)
            for j in free[i]:
                vals[j] = None
        return [vals[o] for o in g.outputs]
