"""Graph -> executable, through the caches.

    exe = compile_graph(graph, site="lazy:train.py:42")
    outputs = exe(inputs)

Order: memory cache, then disk cache (a hit skips the pass pipeline and code generation), then a
real compile: the pass pipeline and the passes of the backend ``config.backend`` names, then that
backend's build (:mod:`kiln.codegen`: generated C++ kernels, or the reference interpreter).  Every step is counted in :mod:`kiln.metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln import metrics
from kiln.codegen import get_backend
from kiln.config import config
from kiln.ir.graph import Graph
from kiln.passes.pipeline import run_pipeline
from kiln.runtime import explain
from kiln.runtime.cache import DiskCache, MemoryCache, cache_key, check_cache_dir
from kiln.runtime.collectives import check_waits
from kiln.runtime.malloc import tune_malloc

_memory = MemoryCache()


@dataclass
class Executable:
    graph: Graph  # the optimized graph
    run: Callable[[Sequence[Any]], list[Any]]
    source_graph_hash: str = ""
    info: dict = field(default_factory=dict)
    runs: int = 0  # times run in this process (kiln top)

    def __call__(self, inputs: Sequence[Any], steal: bool = False) -> list[Any]:
        """Run the graph.  ``steal=True``: ``inputs`` is a list the caller gives up; a backend
        that can (``run.steals``) empties it and frees each input after its last use."""
        self.runs += 1
        if metrics.profiling():
            with metrics.span(f"kiln::graph {self.source_graph_hash[:12]}"):
                return self._run(inputs, steal)
        return self._run(inputs, steal)

    def _run(self, inputs: Sequence[Any], steal: bool) -> list[Any]:
        if steal and getattr(self.run, "steals", False):
            return self.run(inputs, steal=True)
        return self.run(inputs)


def _backend_build(g: Graph) -> tuple[Callable, dict]:
    return get_backend(config.backend).build(g)


def optimize(g: Graph, trace: list | None = None) -> Graph:
    """The generic pass pipeline, then the passes the configured backend adds."""
    return run_pipeline(g, trace, get_backend(config.backend).passes())


def compile_graph(g: Graph) -> Executable:
    sr = "|sr" if config.stochastic_rounding else ""  # kernels round stochastically
    key = cache_key(g.hash, config.backend, ",".join(sorted(config.disabled_passes)) + sr)
    exe = _memory.get(key)
    if exe is not None:
        metrics.incr("cache_hits_memory")
        return exe
    check_waits(g)  # before anything runs: a collective used before its wait_tensor
    check_cache_dir(config.cache_dir)  # kernels are built there even without the disk cache
    tune_malloc()  # once per process (kiln/runtime/malloc.py)
    with metrics.span(f"kiln::compile {g.hash[:12]}"):
        exe = _compile(g, key)
    _memory.put(key, exe)
    return exe


def _compile(g: Graph, key: str) -> Executable:
    """A memory-cache miss: load from the disk cache or optimize, then build the backend."""
    t0 = time.perf_counter()
    disk = DiskCache(config.cache_dir) if config.disk_cache else None
    opt = disk.load(key) if disk else None
    built = False
    passes: list = []
    if opt is None:
        if disk:
            with disk.lock(key):
                opt = disk.load(key)  # another process may have just built it
                if opt is None:
                    opt, built = optimize(g, passes), True
                    disk.store(key, opt)
        else:
            opt, built = optimize(g, passes), True
    run, info = _backend_build(opt)
    dt = time.perf_counter() - t0
    if built:
        metrics.compiled(dt, len(g))
    else:
        metrics.incr("cache_hits_disk")
        metrics.loaded(dt)
    if config.log_enabled("graphs"):
        print(f"[kiln] compiled graph {g.hash} ({len(g)} nodes -> {len(opt)}) in {dt * 1e3:.1f} ms")
        print(opt)
    seed_index = next((n.kwarg("index") for n in opt.nodes if n.kwarg("role") == "seed"), None)
    if seed_index is not None:
        run = _seeded(run, seed_index)
    if config.explain_dir:
        explain.write(config.explain_dir, explain.report(g, opt, passes, info, not built))
    return Executable(opt, run, g.hash, info)


def _seeded(run: Callable, seed_index: int) -> Callable:
    """Random ops of a lazy graph draw from a generator seeded by the graph's seed input, so a new
    seed each step is a new input value, not a new graph."""

    def seeded(inputs: Sequence[Any]) -> list[Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(inputs[seed_index]))
            return run(inputs)

    return seeded


def executables() -> list[Executable]:
    """The compiled graphs this process holds, least recently used first (``kiln top``)."""
    return _memory.values()


def clear_memory_cache() -> None:
    _memory.clear()
