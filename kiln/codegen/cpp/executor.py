"""Runs an optimized graph: fused nodes call generated kernels, all others go through ATen.

The executor is prepared once per graph (a list of steps with everything the hot loop needs bound
in closures) and run many times.  Values are dropped right after their last use.  When the graph
carries a memory plan (``kiln.passes.memory_plan``), fused outputs are written into slot buffers
(reused between dead values, and in place over a dying input) instead of fresh ones; the slots are
given back at the end of each run, so a graph holds no memory between its runs.

By default the graph runs as one native call (:mod:`kiln.codegen.cpp.launcher`, a program built
by :mod:`kiln.codegen.cpp.program`): no Python per node.  The straight-line Python function below
is the fallback (``KILN_LAUNCHER=0``, or no working C++ compiler) and what runs while a profiler
records (kernels and fallbacks as named ranges, :mod:`kiln.observe.ranges`).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.autograd.profiler as _profiler

from kiln import metrics
from kiln.codegen.cpp import launcher
from kiln.codegen.cpp.aten_call import inline_call, prepared
from kiln.codegen.cpp.emit import KernelSpec
from kiln.codegen.cpp.program import build_program
from kiln.config import config
from kiln.ir.graph import Graph
from kiln.ir.layout import dense_order
from kiln.ir.kernel import OutKind
from kiln.ir.semantics import last_uses, writeback
from kiln.precision.rounding import key_halves, next_key

_P = ctypes.c_void_p
_I = ctypes.c_int64
_D = ctypes.c_double


def new_output(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's output buffer: uninitialized, every element is the kernel's to write (the
    tests replace this with a NaN-filled allocation to catch a kernel that skips elements)."""
    return torch.empty(shape, dtype=dtype)


_NEW_OUTPUT = new_output


def shared_layout(full: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The strides a flat kernel's full inputs share where that is one dense layout other than
    contiguous (channels-last): they are read as stored and the outputs made in that layout, as
    eager's elementwise ops keep it; None otherwise (the inputs are made contiguous)."""
    if not full:
        return None
    t0 = full[0]
    if t0.is_contiguous() or not t0.numel() or dense_order(t0.shape, t0.stride()) is None:
        return None
    strides = t0.stride()
    if any(t.shape != t0.shape or t.stride() != strides for t in full[1:]):
        return None
    return strides


def laid_out_output(shape: tuple, dtype: torch.dtype, layout: tuple | None) -> torch.Tensor:
    if layout is None:
        return new_output(shape, dtype)
    return new_output(shape, dtype).as_strided(shape, layout)


def is_laid_out(t: torch.Tensor, layout: tuple | None) -> bool:
    return t.is_contiguous() if layout is None else t.stride() == layout


class KernelInputDtypeError(RuntimeError):
    """A generated kernel got a tensor of another dtype than its graph says (its C++ would read
    the memory as the graph's dtype)."""


def dtype_mismatch(spec: KernelSpec, p: int, got: torch.dtype) -> KernelInputDtypeError:
    return KernelInputDtypeError(
        f"kiln kernel {spec.name}: tensor input {p} is {got}, but the graph says "
        f"{spec.in_dtypes[p]} (an ATen call returned another dtype than torch's shape function "
        "said, a Kiln bug to report); KILN_BACKEND=interpreter runs the graph without generated "
        "kernels"
    )


def make_fused_call(
    spec: KernelSpec, fn: Any, plan: tuple | None, slots: dict, final: frozenset = frozenset()
) -> Callable:
    """A callable ``(input values) -> output tensors`` for one fused node.

    ``final``: the outputs that are the last in the graph placed in their plan slot: their buffer
    leaves the slot with the value, so that it is freed when the value dies, as in eager.

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

    in_dtypes = spec.in_dtypes
    flat = spec.flat

    def call(ins: Sequence[Any]) -> list[torch.Tensor]:
        ts = [ins[k] for k in tin]
        for p, dt in enumerate(in_dtypes):
            # an empty input is never read (ATen's CPU native_dropout returns an empty input's
            # mask as a float tensor, torch's shape function says bool)
            if ts[p].dtype != dt and ts[p].numel():
                raise dtype_mismatch(spec, p, ts[p].dtype)
        layout = shared_layout([ts[p] for p in full]) if flat else None
        if layout is None:
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
                buf = laid_out_output(osh, dt, layout)
            elif isinstance(slot, tuple):  # InPlace ("arg", q): update input q in place
                buf = ins[slot[1]]
                if not (is_laid_out(buf, layout) and buf.shape == osh and buf.dtype == dt):
                    buf = laid_out_output(osh, dt, layout)  # the writeback copies instead
            else:
                buf = slots.get(slot)
                if (
                    buf is None
                    or buf.shape != osh
                    or buf.dtype != dt
                    or not is_laid_out(buf, layout)
                ):
                    buf = laid_out_output(osh, dt, layout)
                    slots[slot] = buf
                if o in final:
                    del slots[slot]
            results.append(buf)
        ptrs = PA(*[t.data_ptr() for t in ts], *[t.data_ptr() for t in results])
        if sr:
            da = DA(*[float(ins[k]) for k in sins], *key_halves(next_key()))
        else:
            da = DA(*[float(ins[k]) for k in sins]) if sins else no_scalars
        fn(ptrs, ia, da)
        return results

    call.kiln_kernel = spec.name  # type: ignore[attr-defined]  # profiler range name
    call.kiln_native = (spec, fn, plan)  # type: ignore[attr-defined]  # for the native launcher
    return call


class Executor:
    """A graph with its kernels, prepared once, run many times."""

    def __init__(self, g: Graph, calls: dict[int, Callable], slots: dict | None = None) -> None:
        self.graph = g
        _LIVE.add(self)
        self._slots = slots if slots is not None else {}  # the kernels' memory-plan buffers
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

        self.native = self._native()
        # the graph as Python source: the fallback, and what profiled runs execute (with ranges);
        # generated on first use where the native launcher runs the graph
        self._fast: Callable[[Sequence[Any]], list[Any]] | None = None
        if self.native is None:
            self._generate()

    @property
    def source(self) -> str:
        if self._fast is None:
            self._generate()
        return self._source

    @property
    def namespace(self) -> dict[str, Any]:
        if self._fast is None:
            self._generate()
        return self._namespace

    def _native(self) -> Any:
        """The graph as one native launcher program (None: the Python function runs it)."""
        if not config.launcher:
            return None
        try:
            mod = launcher.load()
        except launcher.LauncherUnavailable:
            metrics.incr("launcher_fallback_graphs")
            return None
        prog, n_slots = build_program(self.graph, self.steps)
        native = mod.Launcher(len(self.graph.nodes), prog, list(self.graph.outputs), n_slots)
        _NATIVE.add(self)
        metrics.incr("launcher_graphs")
        metrics.incr("launcher_python_nodes", native.python_nodes())
        return native

    steals = True  # may take over its caller's input list (see __call__)

    def __call__(self, inputs: Sequence[Any], steal: bool = False) -> list[Any]:
        """Run the graph.  ``steal=True`` (``inputs`` a list the caller gives up, AOTAutograd's
        boxed convention): the list is emptied once read and each input is dropped after its
        last use, so a backward graph frees saved activations as it goes, as eager does."""
        with self._lock:  # slot buffers are shared between runs of this executable
            if _profiler._is_profiler_enabled and metrics.profiled_runner is not None:
                try:
                    return metrics.profiled_runner(self)(inputs)  # kernels as named ranges
                finally:
                    self._slots.clear()
            if self.native is None or not config.launcher:  # switched off after the build
                try:
                    return (self._fast or self._generate())(inputs, steal)
                finally:
                    # slot values die within a run: nothing is held between runs (the launcher
                    # gives its slots back too)
                    self._slots.clear()
            # the tests' NaN-filling output allocator, where installed, allocates natively too
            alloc = None if new_output is _NEW_OUTPUT else new_output
            outs, copies = self.native.run(inputs, alloc, steal)
            if copies:
                metrics.incr("input_update_copies", copies)
            return outs

    def _generate(self) -> Callable[[Sequence[Any]], list[Any]]:
        """The graph as one straight-line Python function (locals instead of a value list, ATen
        ops called with their arguments in place, getitem inlined, values deleted after their
        last use): no per-step interpretation of the step list at run time."""
        ns: dict[str, Any] = {"writeback": writeback}
        lines = ["def run(inputs, steal=False):"]
        last_input = max((i for i, s in enumerate(self.steps) if s[0] == 0), default=-1)
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
            elif kind == 4 and (call := inline_call(n, i, inp, ns)) is not None:
                lines.append(f"    v{i} = {call}")
            else:
                ns[f"F{i}"] = x if kind != 4 else prepared(n)
                lines.append(f"    v{i} = F{i}([{args}])" + ("[0]" if kind == 2 else ""))
            if i == last_input:  # every input is read: a stolen list is the caller's no more
                lines.append("    if steal:")
                lines.append("        inputs.clear()")
            if free:
                lines.append(f"    del {', '.join(f'v{j}' for j in sorted(set(free)))}")
        lines.append(f"    return [{', '.join(f'v{o}' for o in self.graph.outputs)}]")
        self._source = "\n".join(lines) + "\n"
        exec(compile(self._source, f"<kiln graph {self.graph.hash}>", "exec"), ns)
        self._namespace = ns
        self._fast = ns["run"]
        return ns["run"]


# Executors whose graphs run on the native launcher: where per-node times are read from.
_NATIVE: weakref.WeakSet[Executor] = weakref.WeakSet()
# Every executor alive: what graph constants the process holds
_LIVE: weakref.WeakSet[Executor] = weakref.WeakSet()
_KINDS = {2: "kernel", 3: "aten", 5: "writeback", 6: "python"}


def held_constant_bytes() -> int:
    """Bytes of the constants (folded values, captured tensors) that live graphs hold, each
    storage counted once: memory compiled graphs keep between runs where eager builds the value
    again each step."""
    seen: dict[int, int] = {}
    for ex in list(_LIVE):
        for c in ex.graph.constants:
            if isinstance(c, torch.Tensor):
                st = c.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def set_node_timing(on: bool) -> bool:
    """Switch the native launcher's per-node wall-time recording on or off (every graph); False
    where graphs do not run on the launcher (nothing is recorded then)."""
    if not launcher.available():
        return False
    launcher.load().set_timing(on)
    return True


def take_node_times() -> list[tuple[str, str, str, float, int]]:
    """(graph hash, kind, name, seconds, runs) per graph node timed since the last call, and
    clears them.  ``name``: a generated kernel's name, else the node's op."""
    out = []
    for ex in list(_NATIVE):
        for node, kind, secs, runs in ex.native.take_times():
            if kind not in _KINDS:  # reading inputs and constants, taking tuple elements
                continue
            step = ex.steps[node][1]
            name = getattr(step, "kiln_kernel", None) or ex.graph.nodes[node].op
            out.append((ex.graph.hash, _KINDS[kind], name, secs, runs))
    return out
