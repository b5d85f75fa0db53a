"""The native lazy recorder: op capture in C++ (``recorder.cpp`` and the headers it includes),
the kiln device's recorder by default (:mod:`.device`); ops outside its C++ table go through a boxed fallback to Python
(``fallback.py``, counted), so none is lost.

    from kiln.frontends.lazy import native
    x = native.tensor(torch.randn(4, 64))     # a native kiln tensor holding this value
    w = native.tensor(torch.randn(64, 8))
    y = (x + 0.5).relu() @ w                  # recorded in C++: no Kiln Python runs per op
    native.mark_step()                        # cut, convert to Kiln IR (new graphs only), run
    native.cpu(y)                             # the value

Native tensors use the PrivateUse2 dispatch key (the device's factories, on PrivateUse1, make them
through :mod:`.device`; the Python recorder's ``LazyTensor`` is on PrivateUse1 and the Python
key, and what is registered here does not see it).
The recorder is a PyTorch C++ extension built once per machine and cached with the native graph
launcher (:mod:`kiln.codegen.cpp.extension`).  Where it cannot be built, :func:`load` raises
:class:`NativeUnavailable` with the reason, and the Python recorder is what there is.
See docs/native_recorder.md for the design and the staged plan.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kiln import metrics
from kiln.codegen.cpp.build import BuildError
from kiln.codegen.cpp.extension import Extension, Unavailable
from kiln.frontends.lazy import dynamic
from kiln.frontends.lazy.memory import update_peak
from kiln.frontends.lazy.native import c10d, fallback, rng, table
from kiln.frontends.lazy.native.convert import Converted, convert
from kiln.frontends.lazy.trace import _settle_heap as settle_heap
from kiln.ir.graph import Graph
from kiln.ir.ops import Category
from kiln.runtime.steps import Recompiles, Signature, call_site, python_frames, step_end

__all__ = [
    "NativeUnavailable",
    "available",
    "cpu",
    "graph_of",
    "last_graph",
    "load",
    "mark_step",
    "python_ops",
    "tensor",
    "trace_hash",
    "trace_len",
]

_HERE = Path(__file__).parent
# recorder.cpp includes these (one translation unit); all of them are in the build's cache key
HEADERS = (
    "tensor.h",
    "trace.h",
    "op_table.h",
    "record.h",
    "foreach.h",
    "inplace.h",
    "cut.h",
    "api.h",
    "attention.h",
)
# ... and this one, shared with the device guard extension (lazy/guard.h)
SHARED_HEADERS = ("guard.h",)
_EXT = Extension(
    "kiln_native_recorder",
    _HERE / "recorder.cpp",
    ["-O2", "-w"],
    "native lazy recorder",
    headers=(*(_HERE / h for h in HEADERS), *(_HERE.parent / h for h in SHARED_HEADERS)),
)


@dataclass
class _Entry:
    """What a native graph id runs, worked out once per id (a steady step only looks it up): its
    Kiln graph, the recompile signature, and the shape-generic decision ``run`` =
    (``config.dynamic_shapes`` when made, graph to compile, its extra symbol ints), as the Python
    recorder's ``trace._Entry``."""

    conv: Converted
    signature: Signature = field(init=False)
    run: tuple[bool, Graph, list[int]] | None = None
    # whether a forced read may run this graph on its own, leaving the trace as it is (:func:`peek`)
    peekable: bool = field(init=False)
    # a peeked graph with no inputs computes the same values every time (its nodes are its whole
    # definition; random, collective and opaque nodes are never peeked): they are kept after the
    # first run (:func:`peek`)
    peeked: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        g = self.conv.graph
        types = tuple(g.nodes[i].types[0] for i in g.inputs)
        self.signature = Signature(types, g.hash, len(g))
        work = [n for n in g.nodes if n.category is not Category.META]
        self.peekable = len(work) <= PEEK_MAX_NODES and not any(
            n.category in _NOT_PEEKED for n in work
        )


# A forced read computes only what it needs (:func:`peek`) when that is at most this many nodes,
# none of them of these categories: the step computes those nodes again at its cut, which must
# stay cheap (a GEMM's recomputation is not: ``loss.item()`` before ``mark_step`` cuts the whole
# step, as before) and give the same values (a random op's draws belong to the step; a collective
# or an opaque ATen call may have effects of its own).
PEEK_MAX_NODES = 64
_NOT_PEEKED = (Category.MATMUL, Category.RANDOM, Category.COLLECTIVE, Category.OPAQUE)


_lock = threading.Lock()
_recompiles = Recompiles()  # the native recorder's call sites (as trace._recompiles)
_run_lock = threading.Lock()  # _graphs and lazy.dynamic's families: one cut decides at a time
_configured: list[ModuleType] = []
_graphs: dict[int, _Entry] = {}  # native graph id -> its Kiln graph and how it runs
_handler: list[fallback.Handler] = []  # the Python fallback installed by load()
_libs: list[torch.library.Library] = []  # registrations load() made, kept alive


class NativeUnavailable(RuntimeError):
    """The native recorder cannot be built or loaded here (no C++ compiler, a failed build)."""


def load() -> ModuleType:
    """The recorder extension, built on first use and its op table registered (raises
    :class:`NativeUnavailable` naming the reason; the Python recorder still works)."""
    if _configured:
        return _configured[0]
    with _lock:
        if _configured:
            return _configured[0]
        try:
            mod = _EXT.load()
        except Unavailable as e:
            raise NativeUnavailable(str(e)) from None
        except (BuildError, OSError, ImportError) as e:
            raise NativeUnavailable(
                _EXT.unavailable(
                    e,
                    "it needs a working C++ compiler (g++) and PyTorch's headers. The kiln "
                    "device's Python recorder is unaffected.",
                )
            ) from None
        mod.configure(
            table.OPS,
            table.STRUCTURAL,
            table.FILLS,
            table.foreach_splits(),
            table.inplace_pairs(),
        )
        # the kiln device's guard in C++: a Python error raised inside a backward pass (a hook)
        # then reaches backward() instead of ending the process (lazy/guard.h)
        mod.install_device_guard()
        handler = fallback.Handler(mod, lambda reason: mark_step(forced=True, reason=reason), peek)
        mod.set_fallback(handler)
        mod.set_foreach_hooks(
            fallback._device_active, lambda: metrics.incr("native_inplace_writes")
        )
        _libs.extend(c10d.register(handler))  # collectives a ProcessGroup dispatches
        _handler.append(handler)
        _configured.append(mod)
        return mod


def available() -> bool:
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def loaded() -> bool:
    """Whether :func:`load` has succeeded in this process (asks nothing, builds nothing)."""
    return bool(_configured)


def is_native(x: torch.Tensor) -> bool:
    """Whether ``x`` is a native kiln tensor (False while the recorder is not loaded)."""
    return bool(_configured) and _configured[0].is_native(x)


def value_for(x: torch.Tensor, reason: str) -> torch.Tensor:
    """The CPU value of a native tensor, running the pending step first (a forced sync counted
    under ``reason`` when anything is pending)."""
    _handler[0].sync(reason)
    return load().value(x)


def held_bytes() -> int:
    """Bytes of the host buffers that live native tensors' storages hold (each buffer once)."""
    return load().held_bytes()


def tensor(value: torch.Tensor) -> torch.Tensor:
    """A native kiln tensor holding ``value`` (a CPU tensor; used as a graph input, not copied:
    do not change it in place before the step that reads it has run).  A step never writes into
    ``value``: an in-place update of the native tensor gives it a buffer of its own."""
    return load().from_cpu(value.detach(), borrowed=True)


def cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU value of a native tensor whose step has run (``mark_step``): its storage's buffer
    (a view of it), not a copy -- a later step that updates ``x`` in place writes into it, as into
    an eager tensor's storage (``x.cpu()`` on the kiln device copies)."""
    return load().value(x)


def trace_hash() -> int:
    """The pending trace's structural hash (updated as each op is recorded)."""
    return load().trace_hash()


def trace_len() -> int:
    return load().trace_len()


def mark_step(forced: bool = False, reason: str | None = None, ends_step: bool = True) -> Any:
    """Cut the pending trace and run it: every native tensor still alive that holds a value
    computed in this step gets it.  A graph seen before is recognised by the recorder (hash, then
    node keys) and not converted again.  ``forced``: a sync the program did not ask for (a
    ``.cpu()``, a data-dependent op; ``reason`` names it), which does not end a step.  Returns
    the cut (``graph_id``, ``is_new``, ``hash``), or None when nothing was pending.

    While a profiler runs, the stages appear as the Python recorder's do (``lazy/trace.py``
    ``sync``): ``kiln::mark_step`` or ``kiln::sync <reason>`` around the cut and its run, and
    ``kiln::record`` from the end of one cut to the start of the next."""
    mod = load()
    metrics.close_span("record")
    compiled = False
    with metrics.span(f"kiln::sync {reason or 'forced'}" if forced else "kiln::mark_step"):
        c = mod.cut()
        if c.graph_id >= 0:
            values = c.values()
            results, compiled = _run(mod, c, values)
            _assign(c, results)
            del values, results
    metrics.open_span("record", "kiln::record")
    if c.graph_id < 0:
        return None
    random_ops = rng.active()
    if random_ops is not None:
        random_ops.cut()  # the cut trace's random outputs, kept for replays, let go
    if compiled:
        settle_heap()  # config.gc_freeze; one process-wide cap shared with the Python recorder
    if not forced and ends_step:
        step_end(metrics.get("mark_steps"))
    return c


def peek(xs: list[torch.Tensor], reason: str) -> list[torch.Tensor] | None:
    """The values of the native tensors ``xs`` for a forced read (``reason``) without cutting the
    step: only the pending nodes they depend on run, as their own (cached) graph, and the trace
    stays as it is, so the step is still one graph at its cut (which computes those nodes
    again).  None where that does not serve (:data:`PEEK_MAX_NODES`, :data:`_NOT_PEEKED`): the
    caller then cuts the whole trace.  Counted as a forced sync (``reason``) and as a
    ``partial_syncs``."""
    mod = load()
    c = mod.peek(xs)
    if c is None:  # nothing pending: the values are there
        return [mod.value(x) for x in xs]
    with _run_lock:
        e = _entry(mod, c)
        if not e.peekable:
            return None
    metrics.forced_sync(reason)
    metrics.incr("partial_syncs")
    if e.peeked is not None:  # (transformers' per-step check of a mask it built from sizes)
        metrics.incr("partial_syncs_reused")
        return [v.clone() for v in e.peeked]
    with metrics.span(f"kiln::sync {reason} (partial)"):
        values = c.values()
        results, compiled = _run(mod, c, values)
    if compiled:
        settle_heap()  # as mark_step does after a new graph
    if not values and all(isinstance(r, torch.Tensor) for r in results):
        e.peeked = [r.clone() for r in results]
    return list(results)


def _entry(mod: ModuleType, c: Any) -> _Entry:
    """The cut's graph id's entry, its graph converted on first sight (under ``_run_lock``)."""
    e = _graphs.get(c.graph_id)
    if e is None:
        e = _graphs[c.graph_id] = _Entry(convert(mod, c))
    return e


def _run(mod: ModuleType, c: Any, values: list[Any]) -> tuple[list[Any], bool]:
    """Run the cut ``c`` (its input ``values``): its graph id's Kiln graph, converted on first
    sight, or the shape-generic graph of its family (:mod:`kiln.frontends.lazy.dynamic`) with the
    symbol ints; the recompile accounting of the call site.  Returns (results, whether a graph was
    compiled or loaded from the disk cache for it)."""
    with _run_lock:
        e = _entry(mod, c)
        g = e.conv.graph
        exe, run, compiled = dynamic.compiled(e, g)
    site = call_site("lazy", python_frames()) or "lazy:<unknown>"
    _recompiles.seen(site, e.signature, compiled=compiled)
    args = [values[k] for k in e.conv.picks] + run[2]
    t0 = time.perf_counter()
    results = exe(args)
    metrics.executed(time.perf_counter() - t0)  # (graphs_executed, execute_s)
    return results, compiled


def _assign(c: Any, results: Any) -> None:
    """The live storages take the step's results.  An updated storage that came into the step as
    a graph input got its new value written into its own buffer by the graph (a ``writeback``,
    ``convert.py``): it keeps that buffer; a result sharing a buffer with an input or another
    result is copied (the recorder's ``Cut.assign``)."""
    c.assign(list(results))
    _last_graph[0] = c.graph_id
    update_peak()


_last_graph = [-1]  # the native graph id of the last step run


def last_graph() -> Any:
    """The Kiln IR graph of the last native step run (tests, tools), or None."""
    e = _graphs.get(_last_graph[0])
    return e.conv.graph if e is not None else None


def factory(func: Any, args: tuple, kwargs: dict) -> Any:
    """A factory with ``device=kiln`` recorded as a graph node (a random one seeded, stage 5's
    rules): ``fallback.Handler.factory``."""
    load()
    return _handler[0].factory(func, args, kwargs)


def factory_replayer(func: Any, args: tuple, kwargs: dict) -> Any:
    """A function recording again the node :func:`factory` just recorded for this call, where
    that node has no graph input (``fallback.Handler.factory_replayer``), else None."""
    return _handler[0].factory_replayer(func, args, kwargs)


def python_ops() -> dict[str, int]:
    """Calls handed to the Python fallback since the process started, per ATen overload."""
    return fallback.python_ops()


def graph_of(graph_id: int) -> Any:
    """The Kiln IR graph a native graph id was converted to (tests, tools)."""
    return _graphs[graph_id].conv.graph
