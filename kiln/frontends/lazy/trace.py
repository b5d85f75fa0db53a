"""The pending graph of the lazy device, and cutting it (``mark_step``).

Every op on a lazy tensor appends one node to the current :class:`Trace`.  A :class:`Storage` is the
value behind a tensor and all its views: either concrete data (a CPU tensor) or a pending node of the
trace.  ``sync`` cuts the trace: the outputs are the pending values of every storage still alive,
the graph is pruned to what they need, compiled (looked up by structural hash, so a steady training
loop compiles nothing after its first step), run, and every live storage gets its new data.
"""

from __future__ import annotations

import hashlib
import gc
import threading
import time
import weakref
from typing import Any

import torch

from kiln import metrics
from kiln.config import config
from kiln.frontends.lazy.memory import track, update_peak
from kiln.ir.graph import (
    Graph,
    GraphBuilder,
    Node,
    TensorType,
    canonical_text,
    tensor_digest,
)
from kiln.runtime.compiler import compile_graph
from kiln.runtime.steps import Recompiles, Signature, call_site, python_frames, step_end
from kiln.runtime.writebacks import Update, add_writebacks
from kiln.ir.ops import fresh_buffer
from kiln.ir.semantics import types_of


class Storage:
    """The value behind one lazy tensor and all of its views (its *base* value)."""

    __slots__ = ("data", "node", "gen", "pending", "meta", "imported", "__weakref__")

    def __init__(self, meta: torch.Tensor, data: torch.Tensor | None = None) -> None:
        self.meta = meta  # meta tensor with the base's shape, strides and dtype
        self.data = data  # concrete CPU value when materialized
        self.node: int | None = None  # id in the trace of generation ``gen``
        self.gen = -1
        self.pending = False  # node is a computed value that ``data`` does not hold yet
        self.imported: tuple[int, int] | None = None  # (trace gen, input node) of ``data``


class Trace:
    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.b = GraphBuilder()
        self.values: list[Any] = []  # concrete value of each graph input, by input index
        self.pending: weakref.WeakSet[Storage] = weakref.WeakSet()
        self.seed_node: int | None = None
        self.scalar_nodes: dict[tuple, int] = {}
        self.t0 = time.perf_counter()
        # Random ops recorded in this trace, in order: (node without inputs, its inputs, outputs).
        # ``replay`` is where ``torch.kiln.set_rng_state`` rewound the RNG to (see rng_mark).
        self.randoms: list[tuple[Node, tuple[int, ...], Any]] = []
        self.replay: int | None = None

    def add(self, node: Node) -> int:
        return self.b.add(node)

    def import_storage(self, st: Storage) -> int:
        """The node holding ``st``'s value in this trace (an input node on first use)."""
        if st.gen == self.gen and st.node is not None:
            return st.node
        if st.data is None:
            raise RuntimeError("Kiln internal error: lazy storage with neither data nor node")
        st.node = self.b.input(TensorType(tuple(st.data.shape), st.data.dtype))
        st.gen = self.gen
        st.pending = False
        st.imported = (self.gen, st.node)
        self.values.append(st.data)
        return st.node

    def import_tensor(self, t: torch.Tensor) -> int:
        """A CPU tensor used by the step (copied in: later changes to it are not seen)."""
        i = self.b.input(TensorType(tuple(t.shape), t.dtype))
        self.values.append(t.detach().clone())
        return i

    def scalar(self, value: float | int | bool) -> int:
        py = type(value).__name__
        i = self.b.scalar(py)
        self.values.append(value)
        return i

    def seed(self) -> int:
        """The graph input that seeds every random op of this step (drawn at the cut)."""
        if self.seed_node is None:
            self.seed_node = self.b.scalar("int", role="seed")
            self.values.append(None)  # filled at the cut
        return self.seed_node

    def set_pending(self, st: Storage, node: int) -> None:
        st.node = node
        st.gen = self.gen
        st.pending = True
        self.pending.add(st)


_lock = threading.RLock()
_trace = Trace(0)
_recompiles = Recompiles()


def current() -> Trace:
    return _trace


def rng_mark(state: torch.Tensor) -> torch.Tensor:
    """Tag an RNG state handed out by ``torch.kiln.get_rng_state`` with the point of the trace it
    was taken at (how many random ops were recorded before it)."""
    state._kiln_rng_mark = (_trace.gen, len(_trace.randoms))  # type: ignore[attr-defined]
    return state


def rng_rewind(state: torch.Tensor) -> None:
    """``torch.kiln.set_rng_state(state)``: as in eager, the random ops that follow draw what the
    ones recorded after ``state`` was taken drew.  Within one trace those draws are graph values,
    so the following random ops reuse them (activation checkpointing recomputes its forward this
    way).  A state from an earlier step rewinds the CPU generator, which seeds later steps."""
    mark = getattr(state, "_kiln_rng_mark", None)
    with _lock:
        if mark is not None and mark[0] == _trace.gen and mark[1] < len(_trace.randoms):
            _trace.replay = mark[1]
        else:
            _trace.replay = None


def _prune(tr: Trace, outs: list[int]) -> tuple[Graph, list[Any]]:
    """The part of the trace that the outputs need, renumbered, with its input values.

    A steady loop records the same trace every step, so the pruned graph is cached by the raw
    trace's fingerprint: from the second step on, only the input values are picked out.
    """
    consts = tuple(tensor_digest(c) for c in tr.b.constants)
    key: Any = (tuple(tr.b.nodes), tuple(outs), consts)
    try:
        hit = _pruned.get(key)  # nodes are frozen dataclasses: hashed and compared field by field
    except TypeError:  # an unhashable attribute somewhere: fingerprint the text instead
        h = hashlib.sha256()
        for n in tr.b.nodes:
            h.update(canonical_text(n).encode())
        h.update(repr((outs, consts)).encode())
        key = h.hexdigest()
        hit = _pruned.get(key)
    if hit is None:
        hit = _prune_uncached(tr, outs)
        if len(_pruned) >= 256:
            _pruned.pop(next(iter(_pruned)))
        _pruned[key] = hit
    g, picks = hit
    return g, [tr.values[k] for k in picks]


_pruned: dict[Any, tuple[Graph, list[int]]] = {}


def _prune_uncached(tr: Trace, outs: list[int]) -> tuple[Graph, list[int]]:
    nodes = tr.b.nodes
    need = [False] * len(nodes)
    stack = list(outs)
    while stack:
        i = stack.pop()
        if need[i]:
            continue
        need[i] = True
        stack.extend(nodes[i].inputs)
    has_random = any(need[i] and nodes[i].category.value == "random" for i in range(len(nodes)))
    if has_random and tr.seed_node is not None:
        need[tr.seed_node] = True
    remap: dict[int, int] = {}
    new: list[Node] = []
    picks: list[int] = []
    for i, n in enumerate(nodes):
        if not need[i]:
            continue
        if n.op in ("input", "scalar"):
            picks.append(n.kwarg("index"))
            kw = tuple((k, len(picks) - 1 if k == "index" else v) for k, v in n.kwargs)
            n = n.with_(kwargs=kw)
        else:
            n = n.with_(inputs=tuple(remap[j] for j in n.inputs))
        remap[i] = len(new)
        new.append(n)
    g = Graph(tuple(new), tuple(remap[o] for o in outs), tuple(tr.b.constants))
    return g, picks


def _outputs(tr: Trace, live: list[Storage]) -> list[int]:
    """The output node of each live storage: its new value, or -- when the storage came into this
    trace as an input and its new value is freshly computed -- a ``writeback`` of that value into
    the input's buffer (:mod:`kiln.runtime.writebacks`: parameters and optimizer state updated in
    place, no new buffers each step).  A value that may alias some input (a view, or an input
    itself) stays a plain output: the storage takes it as its new buffer."""
    outs: list[int] = [st.node for st in live]  # type: ignore[misc]
    updates: list[Update] = []
    where: list[int] = []
    for k, st in enumerate(live):
        if st.imported is None or st.imported[0] != tr.gen or st.imported[1] == st.node:
            continue
        n = tr.b.nodes[st.node]  # type: ignore[index]
        updates.append(Update(st.imported[1], st.node, fresh_buffer(n.op, n.category)))  # type: ignore[arg-type]
        where.append(k)
    for k, wb in zip(where, add_writebacks(tr.b, updates, clone_aliased=False)):
        if wb is not None:
            outs[k] = wb
    return outs


def _settle_heap() -> None:
    """With ``config.gc_freeze`` (opt-in, ``KILN_GC_FREEZE=1``), after a step that compiled a new
    graph: collect garbage once, then freeze what is alive.

    Tracing allocates thousands of Python objects per step that live until the cut, so they get
    promoted to CPython's oldest generation and trigger a full collection every ~10 steps, which
    scans every object alive (the model, torch, Kiln's caches: ~400k objects, ~240 ms on the
    tiny-GPT step).  Frozen objects are left out of those scans (``gc.freeze``); they are still
    freed by reference counting as usual.  New graphs are rare (shapes settle in a step or two),
    so this runs a handful of times per process, and never more than ``_SETTLE_MAX`` times (what
    is frozen and later becomes cyclic garbage is not reclaimed; capping bounds that).  Freezing
    acts on every object of the process, the program's own included, hence opt-in.
    """
    global _settled
    if not config.gc_freeze or _settled >= _SETTLE_MAX:
        return
    _settled += 1
    with metrics.span("kiln::settle_heap"):
        gc.collect()
        gc.freeze()
    metrics.incr("heap_freezes")


_SETTLE_MAX = 8
_settled = 0


def sync(reason: str | None = None) -> None:
    """Cut the pending graph, compile it (cached), run it, and materialize live tensors.

    ``reason`` None means an explicit ``mark_step``; anything else is counted as a forced sync.
    """
    global _trace
    metrics.close_span("record")  # profiler ranges: kiln::record, kiln::mark_step / kiln::sync
    with _lock, metrics.span("kiln::mark_step" if reason is None else f"kiln::sync {reason}"):
        tr = _trace
        live = [st for st in list(tr.pending) if st.gen == tr.gen and st.pending]
        _trace = Trace(tr.gen + 1)
        if reason is None:
            metrics.incr("mark_steps")
        if not live:
            return
        if reason is not None and reason != "eager":
            metrics.forced_sync(reason)
        live.sort(key=lambda s: s.node)
        outs = _outputs(tr, live)
        g, values = _prune(tr, outs)
        metrics.traced(time.perf_counter() - tr.t0)
        if tr.seed_node is not None:
            seed_idx = next((n.kwarg("index") for n in g.nodes if n.kwarg("role") == "seed"), None)
            if seed_idx is not None:
                values[seed_idx] = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        site = call_site("lazy", python_frames()) or "lazy:<unknown>"
        before = metrics.get("graphs_compiled") + metrics.get("cache_hits_disk")
        exe = compile_graph(g)
        after = metrics.get("graphs_compiled") + metrics.get("cache_hits_disk")
        inputs = tuple(g.nodes[i].types[0] for i in g.inputs)
        _recompiles.seen(site, Signature(inputs, g.hash, len(g)), compiled=after > before)
        t0 = time.perf_counter()
        results = exe(values)
        metrics.executed(time.perf_counter() - t0)
        settle = after > before
        seen: set[int] = {id(v) for v in values if isinstance(v, torch.Tensor)}
        for st, val in zip(live, results):
            if val is not st.data and id(val) in seen:  # never let two storages share a buffer
                val = val.clone()
            seen.add(id(val))
            st.data = val
            st.pending = False
            st.node = None
            st.gen = -1
            track(st)
        tr = g = values = results = None  # type: ignore[assignment]
        update_peak()
    if settle:
        _settle_heap()
    metrics.open_span("record", "kiln::record")
    if reason is None:
        step_end(metrics.get("mark_steps"))


def out_types(meta: Any) -> tuple[TensorType | None, ...]:
    return types_of(meta)
