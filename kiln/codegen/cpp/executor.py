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
import torch.autograd.profiler as _profiler

from kiln import metrics
from kiln.codegen.cpp.emit import KernelSpec
from kiln.ir.graph import Graph, In, Node
from kiln.ir.kernel import OutKind
from kiln.ir.semantics import call_node, last_uses, resolve, writeback
from kiln.precision.rounding import key_halves, next_key

_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double


def new_output(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's output buffer: uninitialized, every element is the kernel's to write (the
    tests replace this with a NaN-filled allocation to catch a kernel that skips elements)."""
    return torch.empty(shape, dtype=dtype)


def make_fused_call(spec: KernelSpec, fn: Any, plan: tuple | None, slots: dict) -> Callable:
    """A callable ``(input values) -> output tensors`` for one fused node.

    Per call it only checks layouts, allocates (or reuses) outputs and passes pointers: the size
    and stride array and the output shapes are cached per input geometry (a training loop sees
    the same few), and ``fn`` takes the ctypes arrays as they are (no argtypes conversion).
    """
    tin = spec.tensor_inputs
    modes = spec.input_modes
    sins = spec.scalar_inputs
    R = spec.rank
    n_p = len(tin) + len(spec.out_kinds)
    PA = _P * n_p
    static = spec.static_shape if all(isinstance(s, int) for s in spec.static_shape) else None
    anchor = next((p for p, m in enumerate(modes) if m == "full"), None)
    bcast = [p for p, m in enumerate(modes) if m in ("bcast", "bcast_inner")]
    full = [p for p, m in enumerate(modes) if m == "full"]
    inner = [p for p, m in enumerate(modes) if m == "bcast_inner"]
    n_i = R + R * len(bcast)
    IA = _I * max(n_i, 1)
    sr = spec.sr  # stochastic rounding: a fresh random key (two doubles) after the scalars
    DA = _D * max(len(sins) + (2 if sr else 0), 1)
    no_scalars = DA()
    outs = list(zip(spec.out_kinds, spec.out_dtypes))
    out_plan = plan or tuple(None for _ in outs)
    geometry: dict[tuple, tuple] = {}  # sizes + strides -> (int array, output shapes)

    def call(ins: Sequence[Any]) -> list[torch.Tensor]:
        ts = [ins[k] for k in tin]
        for p in full:
            if not ts[p].is_contiguous():
                ts[p] = ts[p].contiguous()
        for p in inner:
            t = ts[p]
            if t.stride(-1) != 1 and t.shape[-1] != 1:
                ts[p] = t.contiguous()
        if anchor is not None:
            shape = tuple(ts[anchor].shape)
        elif static is not None:
            shape = static
        else:
            shape = tuple(torch.broadcast_shapes(*(t.shape for t in ts)))
        key = (shape, *[(ts[p].shape, ts[p].stride()) for p in bcast]) if bcast else shape
        geo = geometry.get(key)
        if geo is None:
            ints = list(shape)
            for p in bcast:
                t = ts[p]
                off = R - t.dim()
                for d in range(R):
                    di = d - off
                    ints.append(0 if di < 0 or t.shape[di] == 1 else t.stride(di))
            geo = (IA(*ints), [OutKind(kind).shape(shape) for kind, _ in outs])
            if len(geometry) < 64:
                geometry[key] = geo
        ia, out_shapes = geo
        results = []
        for o, (osh, (_, dt)) in enumerate(zip(out_shapes, outs)):
            slot = out_plan[o]
            if slot is None:
                buf = new_output(osh, dt)
            elif isinstance(slot, tuple):  # InPlace ("arg", q): update input q in place
                buf = ins[slot[1]]
                if not (buf.is_contiguous() and buf.shape == osh and buf.dtype == dt):
                    buf = new_output(osh, dt)  # the writeback copies instead
            else:
                buf = slots.get(slot)
                if buf is None or buf.shape != osh or buf.dtype != dt:
                    buf = new_output(osh, dt)
                    slots[slot] = buf
            results.append(buf)
        ptrs = PA(*[t.data_ptr() for t in ts], *[t.data_ptr() for t in results])
        if sr:
            da = DA(*[float(ins[k]) for k in sins], *key_halves(next_key()))
        else:
            da = DA(*[float(ins[k]) for k in sins]) if sins else no_scalars
        fn(ptrs, ia, da)
        return results

    call.kiln_kernel = spec.name  # type: ignore[attr-defined]  # profiler range name
    return call


def _has_in(v: Any) -> bool:
    if isinstance(v, In):
        return True
    if isinstance(v, (tuple, list)):
        return any(_has_in(x) for x in v)
    return False


def _filler(v: Any) -> Callable[[Sequence[Any]], Any]:
    """A function ``ins -> v with every In(k) replaced by ins[k]`` (for nested templates)."""
    if isinstance(v, In):
        k = v.k
        return lambda ins: ins[k]
    subs = [(_filler(x) if _has_in(x) else None, x) for x in v]
    seq = type(v)
    return lambda ins: seq(x if f is None else f(ins) for f, x in subs)


def _view(x: torch.Tensor, shape: Any) -> torch.Tensor:
    """``x.view(shape)``; where a Kiln kernel gave ``x`` other strides than the traced graph
    assumed (its outputs are contiguous, eager keeps an input's permuted layout), the view can be
    impossible: the graph is functional, so a reshape (a copy) gives the same values."""
    try:
        return x.view(shape)
    except RuntimeError:
        if x.is_contiguous():
            raise  # not a layout difference: a real error of the graph
        return x.reshape(shape)


# View ops called as Tensor methods: same ATen kernels, without the OpOverload Python dispatch
# (~5 us -> ~2 us a call; a transformer step runs a few hundred of them).
_METHODS: dict[str, Callable] = {
    "view.default": _view,
    "reshape.default": torch.Tensor.reshape,
    "permute.default": torch.Tensor.permute,
    "expand.default": torch.Tensor.expand,
    "unsqueeze.default": torch.Tensor.unsqueeze,
    "squeeze.dim": torch.Tensor.squeeze,
    "t.default": torch.Tensor.t,
    "transpose.int": torch.Tensor.transpose,
    "select.int": torch.Tensor.select,
}


def prepare_aten_call(n: Node) -> Callable[[Sequence[Any]], Any]:
    """``ins -> result`` for a node whose arguments nest graph values (lists of tensors), which
    :func:`_inline_call` cannot spell out: the op and the fill plan are worked out once."""
    fn = _METHODS.get(n.op) or resolve(n.op)
    template = list(n.args)
    direct = [(p, v.k) for p, v in enumerate(template) if isinstance(v, In)]
    nested = [
        (p, _filler(v)) for p, v in enumerate(template) if not isinstance(v, In) and _has_in(v)
    ]
    kw_const = {k: v for k, v in n.kwargs if not _has_in(v)}
    kw_fill = [(k, _filler(v)) for k, v in n.kwargs if _has_in(v)]

    def call(ins: Sequence[Any]) -> Any:
        a = template.copy()
        for p, k in direct:
            a[p] = ins[k]
        for p, f in nested:
            a[p] = f(ins)
        kw = kw_const.copy() if kw_const else {}
        for k, f in kw_fill:
            kw[k] = f(ins)
        return fn(*a, **kw)

    return call


def _inline_call(n: Node, i: int, inp: Sequence[int], ns: dict) -> str | None:
    """``OP(v3, A7_1, ...)``: node ``i``'s ATen call as Python source, its op and constant
    arguments bound in ``ns``; None when an argument nests graph values (lists of tensors)."""
    if any(not isinstance(v, In) and _has_in(v) for v in n.args) or any(
        _has_in(v) for _, v in n.kwargs
    ):
        return None
    try:
        ns[f"OP{i}"] = _METHODS.get(n.op) or resolve(n.op)
    except (AttributeError, KeyError):
        return None
    parts = []
    for p, v in enumerate(n.args):
        if isinstance(v, In):
            parts.append(f"v{inp[v.k]}")
        else:
            ns[f"A{i}_{p}"] = v
            parts.append(f"A{i}_{p}")
    if n.kwargs:
        ns[f"KW{i}"] = dict(n.kwargs)
        parts.append(f"**KW{i}")
    return f"OP{i}({', '.join(parts)})"


def _prepared(n: Node) -> Callable[[Sequence[Any]], Any]:
    try:
        return prepare_aten_call(n)
    except (AttributeError, KeyError):  # unresolvable here: call_node reports it when run
        return lambda ins: call_node(n, ins)


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
            else:  # an ATen call (or getitem / writeback): spelled out by _generate
                steps.append((4, None, n))
        # (kind, callable or value, input ids, ids freed after this step)
        self.steps = [(k, x, n.inputs, tuple(self.free[i])) for i, (k, x, n) in enumerate(steps)]

        self._fast = self._generate()

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        with self._lock:  # slot buffers are shared between runs of this executable
            if _profiler._is_profiler_enabled and metrics.profiled_runner is not None:
                return metrics.profiled_runner(self)(inputs)  # kernels as named ranges
            return self._fast(inputs)

    def _generate(self) -> Callable[[Sequence[Any]], list[Any]]:
        """The graph as one straight-line Python function (locals instead of a value list, ATen
        ops called with their arguments in place, getitem inlined, values deleted after their
        last use): no per-step interpretation of the step list at run time."""
        ns: dict[str, Any] = {"writeback": writeback}
        lines = ["def run(inputs):"]
        for i, (kind, x, inp, free) in enumerate(self.steps):
            n = self.graph.nodes[i]
            args = ", ".join(f"v{j}" for j in inp)
            if kind == 0:
                lines.append(f"    v{i} = inputs[{x}]")
            elif kind == 1:
                ns[f"K{i}"] = x
                lines.append(f"    v{i} = K{i}")
            elif n.op == "getitem":
                lines.append(f"    v{i} = v{inp[0]}[{int(n.args[1])}]")
            elif n.op == "writeback":
                lines.append(f"    v{i} = writeback(v{inp[0]}, v{inp[1]})")
            elif kind == 4 and (call := _inline_call(n, i, inp, ns)) is not None:
                lines.append(f"    v{i} = {call}")
            else:
                ns[f"F{i}"] = x if kind != 4 else _prepared(n)
                lines.append(f"    v{i} = F{i}([{args}])" + ("[0]" if kind == 2 else ""))
            if free:
                lines.append(f"    del {', '.join(f'v{j}' for j in sorted(set(free)))}")
        lines.append(f"    return [{', '.join(f'v{o}' for o in self.graph.outputs)}]")
        self.source = "\n".join(lines) + "\n"
        exec(compile(self.source, f"<kiln graph {self.graph.hash}>", "exec"), ns)
        self.namespace = ns
        return ns["run"]
