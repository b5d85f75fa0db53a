"""C++ code generation backend (registered as ``"cpp"``): ``build(g) -> (run, info)``, after its
own passes (``fuse`` with this backend's :data:`CLAIMS`, then ``memory_plan``).

Every ``fused`` node of the graph becomes one generated C++ function (so does each layer norm,
forward and backward, see :mod:`kiln.codegen.cpp.layer_norm`, and each last-dim (log_)softmax
backward, :mod:`kiln.codegen.cpp.softmax_backward`, each 2-D max pool, forward and backward,
:mod:`kiln.codegen.cpp.pool`, and each 2-D transposing copy, :mod:`kiln.codegen.cpp.transpose`);
identical kernels are shared, and a kernel made of identical independent chains (horizontally fused per-parameter optimizer updates) emits
the chain once, looped over the lanes (:mod:`kiln.codegen.cpp.lanes`).
A kernel built before (by an earlier graph, in this process or another sharing the cache) is
loaded from the unit that holds it; the graph's new kernels go into one translation unit (two,
compiled in parallel, when there are many or they are long), built with g++ through the kernel
cache (:mod:`kiln.codegen.cpp.build`) in build threads: ``build`` returns before g++ ends (a
:class:`~kiln.codegen.cpp.deferred.Deferred` executor), so PyTorch traces and lowers the next
graph meanwhile, and the graph's first run waits for its units.  Everything else
runs through ATen (:mod:`kiln.codegen.cpp.executor`).  ``info["kernels"]`` lists each kernel's
name, the graph nodes fused into it and its C++ source, for ``kiln explain``; ``KILN_LOG=kernels``
prints the sources.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Sequence

from kiln import metrics
from kiln.codegen.base import Backend, Pass, register_backend
from kiln.codegen.cpp.aten_call import prepare_aten_call
from kiln.codegen.cpp.build import start_kernels
from kiln.codegen.cpp.cross_entropy import (
    emit_nll_log_softmax_backward,
    nll_log_softmax_backward_ok,
)
from kiln.codegen.cpp.deferred import Deferred
from kiln.codegen.cpp.emit import KernelSpec, emit_flat, kernel_spec
from kiln.codegen.cpp.executor import Executor, make_fused_call
from kiln.codegen.cpp.lanes import lane_kernel
from kiln.codegen.cpp.layer_norm import emit_layer_norm, layer_norm_ok
from kiln.codegen.cpp.ops import CTYPE, PRELUDE, supported
from kiln.codegen.cpp.pool import emit_pool, pool_call, pool_ok
from kiln.codegen.cpp.softmax_backward import emit_softmax_backward, softmax_backward_ok
from kiln.codegen.cpp.transpose import emit_t_copy, t_copy_ok
from kiln.config import config
from kiln.ir.graph import Graph
from kiln.ir.ops import fresh_buffer
from kiln.passes.cross_entropy import cross_entropy
from kiln.passes.fuse import Claims, fuse
from kiln.passes.gemm_library import gemm_library
from kiln.passes.memory_plan import memory_plan
from kiln.passes.pool_relu import pool_relu
from kiln.passes.relu_pool import relu_pool
from kiln.passes.sink_expand import sink_expand
from kiln.precision import cpp as lowp
from kiln.precision.aten_sr import in_float, sr_call, sr_wanted

# What this backend generates code for: element types with a C type, and calls with a formula.
CLAIMS = Claims(CTYPE, supported)

# ATen ops taken as they stand (no fusion pass): op -> (accepts(node, input types), emitter)
_DIRECT = {
    "native_layer_norm.default": (layer_norm_ok, emit_layer_norm),
    "native_layer_norm_backward.default": (layer_norm_ok, emit_layer_norm),
    "_softmax_backward_data.default": (softmax_backward_ok, emit_softmax_backward),
    "_log_softmax_backward_data.default": (softmax_backward_ok, emit_softmax_backward),
    "nll_log_softmax_backward.default": (
        nll_log_softmax_backward_ok,
        emit_nll_log_softmax_backward,
    ),
    "t_copy.default": (t_copy_ok, emit_t_copy),
}
SPLIT_AT = 8  # more new kernels than this: two units, compiled by two g++ in parallel
# or more new kernel source than this (characters; g++ -O2 takes ~0.1 s per 10,000 of them):
# two units of about equal source (a transformer's backward graph: 8 kernels, ~90,000)
SPLIT_CHARS = 32_000
_SR_CASTS = "kiln_sr_casts"  # the stochastic-rounding cast kernels, as one kernel id


def build(g: Graph) -> tuple[Callable[[Sequence], list], dict]:
    specs: dict[int, KernelSpec] = {}
    unique: dict[str, str] = {}  # kernel name -> source
    pools: dict[int, str] = {}  # max-pool nodes -> their kernel (kiln.codegen.cpp.pool)
    # not a pass: "max_pool" in KILN_DISABLE_PASSES leaves max pooling to ATen (for A/B)
    pool_kernels = "max_pool" not in config.disabled_passes
    for i, n in enumerate(g.nodes):
        in_types = [g.nodes[j].types[0] if g.nodes[j].types else None for j in n.inputs]
        if pool_kernels and pool_ok(n, in_types):
            src = emit_pool("KILN_KERNEL", n)
            name = "kiln_" + hashlib.sha256(src.encode()).hexdigest()[:16]
            pools[i] = name
            unique.setdefault(name, src.replace("KILN_KERNEL", name))
            continue
        if n.op == "fused":
            spec = kernel_spec("KILN_KERNEL", n, in_types)
            # identical per-parameter chains (horizontal fusion): the chain once, looped over
            # the lanes; else (and only then) the whole body as one loop nest
            src = lane_kernel(spec, n, in_types, _input_slots(g, n))
            if src is None:
                src = emit_flat(spec, n, in_types)
        elif n.op in _DIRECT:
            ok, emit = _DIRECT[n.op]
            # arguments or shapes outside the kernel's proven contract: ATen's kernel runs it,
            # counted (kiln.metrics fallbacks) with the reason
            if not ok(n, in_types):
                metrics.fallback(f"{n.op} (arguments outside the Kiln kernel's contract)")
                continue
            try:
                src, spec = emit("KILN_KERNEL", n, in_types)
            except ValueError as e:
                metrics.fallback(f"{n.op} ({e})")
                continue
        else:
            continue
        name = "kiln_" + hashlib.sha256(src.encode()).hexdigest()[:16]
        spec.name = name
        spec.in_dtypes = [in_types[k].dtype for k in spec.tensor_inputs]
        spec.source = src.replace("KILN_KERNEL", name)
        unique.setdefault(name, spec.source)
        specs[i] = spec
    sr_nodes = [i for i, n in enumerate(g.nodes) if i not in specs and sr_wanted(n)]
    # kernel id -> (source, symbols it defines)
    kernels = {name: (src, (name,)) for name, src in unique.items()}
    if sr_nodes:  # stochastic casts for bf16 / fp16 results of ops that run through ATen
        kernels[_SR_CASTS] = (lowp.CAST_KERNELS, tuple(lowp.CAST_NAMES.values()))
    if config.log_enabled("kernels"):
        for name, (src, _) in sorted(kernels.items()):
            print(f"[kiln] generated kernel {name} ({len(src)} chars):\n{src}")
    # kernels built before (in any unit) are loaded from there; the new ones form new units,
    # compiled by g++ in build threads while the caller goes on (the graph's first run waits)
    pending = start_kernels(kernels, PRELUDE, SPLIT_AT, SPLIT_CHARS)
    metrics.incr("fused_kernels", len(specs) + len(pools))
    info = {
        "backend": "cpp",
        "units": pending.n_units,
        "kernels": [
            {
                "name": s.name,
                "node": i,
                "kind": s.kind,
                "members": list(s.members),
                "source": s.source,
            }
            for i, s in specs.items()
        ]
        + [
            {
                "name": k,
                "node": i,
                "kind": "max_pool",
                "members": [g.nodes[i].op],
                "source": unique[k],
            }
            for i, k in pools.items()
        ],
    }
    if pending.running:
        return Deferred(lambda: _executor(g, specs, unique, sr_nodes, pending.wait(), pools)), info
    return _executor(g, specs, unique, sr_nodes, pending.wait(), pools), info


def _executor(
    g: Graph,
    specs: dict[int, KernelSpec],
    unique: dict[str, str],
    sr_nodes: list[int],
    libs: dict[str, ctypes.CDLL],
    pools: dict[int, str],
) -> Executor:
    """The graph's executor, once its kernels' libraries are loaded."""
    fns: dict[str, ctypes._CFuncPtr] = {}
    pool_names = set(pools.values())
    for name in unique:
        if name in pool_names:
            continue
        f = getattr(libs[name], name)
        f.argtypes = None  # called with ctypes arrays only: no per-call conversion
        f.restype = None
        fns[name] = f
    plan = dict(_memory_plan(g))
    slots: dict = {}
    final = _final_slot_uses(plan)
    calls = {
        i: make_fused_call(s, fns[s.name], plan.get(i), slots, final.get(i, frozenset()))
        for i, s in specs.items()
    }
    for i, name in pools.items():
        calls[i] = pool_call(g.nodes[i], getattr(libs[name], name))
    if sr_nodes:
        casts = {}
        for abbr, name in lowp.CAST_NAMES.items():
            f = getattr(libs[_SR_CASTS], name)
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
            f.restype = None
            casts[abbr] = f
        for i in sr_nodes:
            calls[i] = sr_call(g.nodes[i], prepare_aten_call(in_float(g.nodes[i])), casts)
        metrics.incr("sr_aten_nodes", len(sr_nodes))
    return Executor(g, calls, slots)


def _input_slots(g: Graph, n) -> tuple:
    """Per input of ``n``: the memory-plan slot its value sits in (a fused node's output), None
    (a graph input, a constant, an op's fresh result: never in a slot) or ``"?"`` (anything else, a view of a slot's
    value perhaps: may share a buffer with any slot)."""
    res: list = []
    for j in n.inputs:
        src, idx = g.nodes[j], 0
        if src.op == "getitem" and g.nodes[src.inputs[0]].op == "fused":
            src, idx = g.nodes[src.inputs[0]], src.args[1]
        if src.op != "fused":
            fresh = src.op in ("input", "scalar", "constant") or fresh_buffer(src.op, src.category)
            res.append(None if fresh else "?")
            continue
        place = src.kwarg("placement") or ()
        slot = place[idx] if isinstance(idx, int) and idx < len(place) else None
        res.append(slot if isinstance(slot, int) else "?" if slot is not None else None)
    return tuple(res)


def _memory_plan(g: Graph):
    """(node id, per-output placement) pairs from the ``memory_plan`` pass, if it ran."""
    for i, n in enumerate(g.nodes):
        if n.op == "fused":
            p = n.kwarg("placement")
            if p is not None:
                yield i, p


def _final_slot_uses(plan: dict[int, tuple]) -> dict[int, frozenset[int]]:
    """Per fused node, its outputs that are the last value placed in their slot (node order)."""
    last: dict[int, tuple[int, int]] = {}
    for i in sorted(plan):
        for o, slot in enumerate(plan[i]):
            if isinstance(slot, int):
                last[slot] = (i, o)
    res: dict[int, set[int]] = {}
    for i, o in last.values():
        res.setdefault(i, set()).add(o)
    return {i: frozenset(os) for i, os in res.items()}


def fuse_claimed(g: Graph) -> Graph:
    """This backend's fusion pass: pointwise chains and reductions it claims -> kernels."""
    return fuse(g, CLAIMS)


def _passes() -> list[tuple[str, Pass]]:
    """This backend's policy after the generic pipeline: fuse what it claims, then plan buffers."""
    return [
        ("cross_entropy", cross_entropy),  # the loss backward's one-hot + log-softmax backward
        ("sink_expand", sink_expand),  # elementwise ops read an expand's source (rows epilogues)
        ("pool_relu", pool_relu),  # max-pool backward + ReLU backward -> one node
        ("relu_pool", relu_pool),  # ReLU + max pool -> one node
        ("fuse", fuse_claimed),
        ("gemm_library", gemm_library),  # large float32 GEMMs on oneDNN where it measured faster
        ("memory_plan", memory_plan),  # fused outputs reuse dead buffers
    ]


register_backend(Backend("cpp", build, _passes, CLAIMS))
