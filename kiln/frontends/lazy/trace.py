"""The pending graph of the lazy device, and cutting it (``mark_step``).

Every op on a lazy tensor appends one node to the current :class:`Trace`.  A :class:`Storage` is the
value behind a tensor and all its views: either concrete data (a CPU tensor) or a pending node of the
trace.  ``sync`` cuts the trace: the outputs are the pending values of every storage still alive,
the graph is pruned to what they need, compiled (looked up by structural hash, so a steady training
loop compiles nothing after its first step), run, and every live storage gets its new data.
"""

from __future__ import annotations

import gc
import hashlib
import threading
import time
import weakref
from typing import Any

import torch

from kiln import metrics
from kiln.config import config
from kiln.frontends.lazy import dynamic
from kiln.frontends.lazy.memory import track, update_peak
from kiln.ir.graph import (
    Graph,
    GraphBuilder,
    Node,
    TensorType,
    canonical_text,
)
from kiln.ir.ops import fresh_buffer
from kiln.ir.semantics import types_of
from kiln.runtime.steps import Recompiles, Signature, call_site, python_frames, step_end
from kiln.runtime.writebacks import Update, add_writebacks


class Storage:
    """The value behind one lazy tensor and all of its views (its *base* value)."""

    __slots__ = ("__weakref__", "data", "gen", "imported", "meta", "node", "pending")

    def __init__(self, meta: torch.Tensor, data: torch.Tensor | None = None) -> None:
        self.meta = meta  # meta tensor with the base's shape, strides and dtype
        self.data = data  # concrete CPU value when materialized
        self.node: int | None = None  # id in the trace of generation ``gen``
        self.gen = -1
        self.pending = False  # node is a computed value that ``data`` does not hold yet
        self.imported: tuple[int, int] | None = None  # (trace gen, input node) of ``data``

    @classmethod
    def computed(cls, meta: torch.Tensor, tr: Trace, node: int) -> Storage:
        """A new storage whose value is ``node`` of ``tr`` (what ``set_pending`` makes of a fresh
        storage, in one call: the recording fast path makes one per recorded op)."""
        st = cls.__new__(cls)
        st.meta = meta
        st.data = None
        st.node = node
        st.gen = tr.gen
        st.pending = True
        st.imported = None
        tr.pending.append(weakref.ref(st))
        return st


class Trace:
    def __init__(self, gen: int) -> None:
        self.gen = gen
        self.b = GraphBuilder()
        self.values: list[Any] = []  # concrete value of each graph input, by input index
        # storages given a pending value in this trace (weak: a dead one needs no output)
        self.pending: list[weakref.ref[Storage]] = []
        self.seed_node: int | None = None
        self.scalar_nodes: dict[tuple, int] = {}
        self.t0 = time.perf_counter()
        # Random ops recorded in this trace, in order: (node without inputs, its inputs, outputs).
        # ``replay`` is where ``torch.kiln.set_rng_state`` rewound the RNG to (see rng_mark).
        self.randoms: list[tuple[Node, tuple[int, ...], Any]] = []
        self.replay: int | None = None
        # One key per node, equal for equal nodes: (recipe token, inputs) for a node recorded
        # from a recipe, ("input"/"scalar"/"getitem", ...) for those made here, else the node
        # itself (compared field by field).  ``expect`` is the graph this trace recorded last
        # time it followed the same graph (see _Entry): while every key matches its sequence, the
        # trace is that graph again and is recognised at the cut without hashing it.
        self.keys: list[Any] = []
        self.expect: _Entry | None = None

    def _noted(self, i: int, key: Any) -> int:
        self.keys.append(key)
        e = self.expect
        if e is not None and (i >= len(e.keys) or e.keys[i] != key):
            self.expect = None
        return i

    def add(self, node: Node) -> int:
        return self._noted(self.b.add(node), node)

    def add_call(
        self, key: tuple, op: str, inputs: tuple, args: tuple, kw: tuple, types: tuple
    ) -> int:
        """Add the node ``Node(op, inputs, args, kw, types)``, known by ``key`` (its recipe's
        token and its inputs); on a repeated step, the same node object as last time."""
        nodes = self.b.nodes
        i = len(nodes)
        e = self.expect
        if e is not None and i < len(e.keys) and e.keys[i] == key:
            nodes.append(e.nodes[i])  # equal key: equal node (inputs exist: they matched too)
            self.keys.append(key)
            return i
        return self._noted(self.b.add(Node(op, inputs, args, kw, types)), key)

    def getitem(self, src: int, index: int) -> int:
        return self._noted(self.b.getitem(src, index), ("getitem", src, index))

    def import_storage(self, st: Storage) -> int:
        """The node holding ``st``'s value in this trace (an input node on first use)."""
        if st.gen == self.gen and st.node is not None:
            return st.node
        if st.data is None:
            raise RuntimeError("Kiln internal error: lazy storage with neither data nor node")
        data = st.data
        st.node = self._input(("input", len(self.values), tuple(data.shape), data.dtype))
        st.gen = self.gen
        st.pending = False
        st.imported = (self.gen, st.node)
        self.values.append(st.data)
        return st.node

    def import_tensor(self, t: torch.Tensor) -> int:
        """A CPU tensor used by the step (copied in: later changes to it are not seen)."""
        i = self.b.input(TensorType(tuple(t.shape), t.dtype))
        self._noted(i, self.b.nodes[i])
        self.values.append(t.detach().clone())
        return i

    def scalar(self, value: float | bool) -> int:
        i = self._input(("scalar", len(self.values), type(value).__name__))
        self.values.append(value)
        return i

    def _input(self, key: tuple) -> int:
        """An input or scalar node, ``key`` = (kind, input index, shape, dtype) or (kind, input
        index, Python type): on a repeated step, the same node object as last time."""
        i = len(self.b.nodes)
        e = self.expect
        if e is not None and i < len(e.keys) and e.keys[i] == key:
            node = e.nodes[i]
        elif key[0] == "input":
            node = Node("input", kwargs=(("index", key[1]),), types=(TensorType(key[2], key[3]),))
        else:
            node = Node(
                "scalar", kwargs=(("index", key[1]),), types=(TensorType((), None, key[2]),)
            )
        return self._noted(self.b.add(node), key)

    def seed(self) -> int:
        """The graph input that seeds every random op of this step (drawn at the cut)."""
        if self.seed_node is None:
            self.seed_node = self.b.scalar("int", role="seed")
            self._noted(self.seed_node, self.b.nodes[self.seed_node])
            self.values.append(None)  # filled at the cut
        return self.seed_node

    def set_pending(self, st: Storage, node: int) -> None:
        if st.gen != self.gen or not st.pending:  # else listed already
            self.pending.append(weakref.ref(st))
        st.node = node
        st.gen = self.gen
        st.pending = True


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


class _Entry:
    """A pruned graph, cached by the raw trace it came from (``keys``: ``Trace.keys``)."""

    __slots__ = (
        "graph",
        "input_types",
        "keys",
        "next",
        "nodes",
        "outs",
        "picks",
        "run",
        "seed_index",
        "tensor_inputs",
    )

    def __init__(self, graph: Graph, picks: list[int], tr: Trace, outs: tuple) -> None:
        self.graph = graph
        self.picks = picks  # graph input k is the trace's value picks[k]
        self.keys = tr.keys
        self.nodes = tr.b.nodes
        self.outs = outs
        self.next: _Entry | None = None  # the graph of the trace that followed this one last time
        # (config.dynamic_shapes, graph to run, its extra symbol inputs): see lazy.dynamic
        self.run: tuple[bool, Graph, list[int]] | None = None
        # worked out once, used at every cut of this graph
        ins = [graph.nodes[i] for i in graph.inputs]
        self.input_types = tuple(n.types[0] for n in ins)
        self.tensor_inputs = [k for k, n in enumerate(ins) if n.op == "input"]
        self.seed_index = next((n.kwarg("index") for n in ins if n.kwarg("role") == "seed"), None)


def _prune(tr: Trace, outs: list[int]) -> tuple[_Entry, list[Any]]:
    """The part of the trace that the outputs need, renumbered, with its input values.

    A steady loop records the same trace every step, so the pruned graph is cached by the raw
    trace's keys: from the second step on, only the input values are picked out.  A trace that
    matched, node by node, the one recorded after the previous graph last time (``Trace.expect``)
    is that graph without a lookup.
    """
    for i in range(len(tr.keys), len(tr.b.nodes)):  # nodes added straight to the builder
        tr._noted(i, tr.b.nodes[i])  # (writebacks): keyed by themselves
    if tr.b.constants:  # (the lazy device records none today) not keyed: prune every time
        g, picks = _prune_uncached(tr, outs)
        return _Entry(g, picks, tr, tuple(outs)), [tr.values[k] for k in picks]
    out_key = tuple(outs)
    e = tr.expect
    n = len(tr.b.nodes)
    if e is None or len(e.keys) != n or len(tr.keys) != n or e.outs != out_key:
        key: Any = (tuple(tr.keys), out_key)
        try:
            e = _pruned.get(key)
        except TypeError:  # an unhashable attribute somewhere: fingerprint the text instead
            h = hashlib.sha256()
            for node in tr.b.nodes:
                h.update(canonical_text(node).encode())
            h.update(repr(out_key).encode())
            key = h.hexdigest()
            e = _pruned.get(key)
        if e is None:
            g, picks = _prune_uncached(tr, outs)
            e = _Entry(g, picks, tr, out_key)
            if len(_pruned) >= 256:
                _pruned.pop(next(iter(_pruned)))
            _pruned[key] = e
    values = tr.values
    return e, [values[k] for k in e.picks]


_pruned: dict[Any, _Entry] = {}
_last_entry: _Entry | None = None


def _prune_uncached(tr: Trace, outs: list[int]) -> tuple[Graph, list[int]]:
    return prune_nodes(tr.b.nodes, outs, tr.seed_node, tuple(tr.b.constants))


def prune_nodes(
    nodes: list[Node], outs: list[int], seed_node: int | None = None, constants: tuple = ()
) -> tuple[Graph, list[int]]:
    """The graph of what ``outs`` need from a recorded node list, and its input picks.

    Keeps the nodes the outputs reach, renumbers them, and numbers the graph inputs (``input``
    and ``scalar`` nodes' ``index``) in order of use: graph input k is the recorded value
    ``picks[k]``.  ``seed_node`` (the step's random seed input) is kept when a random node is.
    Both recorders' cuts use it: this module's :func:`sync` and the native recorder's
    ``native/convert.py``."""
    need = [False] * len(nodes)
    stack = list(outs)
    while stack:
        i = stack.pop()
        if need[i]:
            continue
        need[i] = True
        stack.extend(nodes[i].inputs)
    if seed_node is not None and any(
        need[i] and nodes[i].category.value == "random" for i in range(len(nodes))
    ):
        need[seed_node] = True
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
    return Graph(tuple(new), tuple(remap[o] for o in outs), constants), picks


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


def sync(reason: str | None = None, ends_step: bool = True) -> None:
    """Cut the pending graph, compile it (cached), run it, and materialize live tensors.

    ``reason`` None means an explicit ``mark_step``, which ends a step (``ends_step=False``: the
    caller ends it); anything else is counted as a forced sync.
    """
    global _trace
    metrics.close_span("record")  # profiler ranges: kiln::record, kiln::mark_step / kiln::sync
    with _lock, metrics.span("kiln::mark_step" if reason is None else f"kiln::sync {reason}"):
        tr = _trace
        live = []
        listed: set[int] = set()
        for ref in tr.pending:
            st = ref()
            if st is not None and st.gen == tr.gen and st.pending and id(st) not in listed:
                listed.add(id(st))
                live.append(st)
        _trace = Trace(tr.gen + 1)
        if reason is None:
            metrics.incr("mark_steps")
        # a mark_step with nothing pending (the debug mode's every one) still ends a step
        settle = _run_cut(tr, live, reason) if live else False
    if settle:
        _settle_heap()
    metrics.open_span("record", "kiln::record")
    if reason is None and ends_step:
        step_end(metrics.get("mark_steps"))


def _run_cut(tr: Trace, live: list, reason: str | None) -> bool:
    """Compile (cached) and run the cut of ``tr`` whose outputs are ``live``, materializing them;
    whether a graph was compiled or loaded (the heap is settled then).  Under ``_lock``."""
    global _last_entry
    if reason is not None and reason != "eager":
        metrics.forced_sync(reason)
    live.sort(key=lambda s: s.node)
    outs = _outputs(tr, live)
    entry, values = _prune(tr, outs)
    g = entry.graph
    if _last_entry is not None:
        _last_entry.next = entry
    _last_entry = entry
    _trace.expect = entry.next
    metrics.traced(time.perf_counter() - tr.t0)
    if tr.seed_node is not None and entry.seed_index is not None:
        values[entry.seed_index] = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    site = call_site("lazy", python_frames()) or "lazy:<unknown>"
    exe, run, compiled = dynamic.compiled(entry, g)
    if reason != "eager":  # the debug mode's one-op graphs are not a site's recompiles
        _recompiles.seen(site, Signature(entry.input_types, g.hash, len(g)), compiled)
    t0 = time.perf_counter()
    results = exe(values + run[2] if run[2] else values)
    metrics.executed(time.perf_counter() - t0)
    settle = compiled
    seen: set[int] = {id(values[k]) for k in entry.tensor_inputs}
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
    return settle


def out_types(meta: Any) -> tuple[TensorType | None, ...]:
    return types_of(meta)
