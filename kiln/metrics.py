"""Counters and timings of everything Kiln does, in one place.

    import kiln
    print(kiln.metrics.report())     # human-readable
    kiln.metrics.counters()          # dict, for tests and dashboards
    kiln.metrics.reset()

Tracked: graphs compiled, cache hits (memory / disk), compile and execute time, graph sizes, forced
syncs (by reason), ops that fell back to eager ATen (by name), recompiles with their reason, and a
warning when one call site keeps recompiling (naming the input that changes).

Also two small hooks for :mod:`kiln.observe`, cheap enough for the step path: :func:`step_done`
(both frontends call it where a training step ends; it runs the functions registered with
:func:`on_step`) and :func:`span` (a named range in ``torch.profiler`` traces, free when no profiler
runs).
"""

from __future__ import annotations

import atexit
import os
import statistics
import threading
import time
import warnings
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.autograd.profiler as _profiler
from torch._C._profiler import _RecordFunctionFast


class RecompileWarning(UserWarning):
    pass


# counters() always has these (0 until counted): the step count and what README's Metrics and
# Tools sections name
ALWAYS = (
    "steps",
    "mark_steps",
    "graphs_compiled",
    "graphs_executed",
    "cache_hits_memory",
    "cache_hits_disk",
    "forced_syncs",
    "recompiles",
)


@dataclass
class _Metrics:
    # the counters a program reads read 0 before the first event, not None or a KeyError
    counters: Counter = field(default_factory=lambda: Counter(dict.fromkeys(ALWAYS, 0)))
    fallbacks: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    compile_s: list[float] = field(default_factory=list)
    execute_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    trace_s: list[float] = field(default_factory=list)
    graph_sizes: list[int] = field(default_factory=list)
    recompiles: list[tuple[str, str]] = field(default_factory=list)  # (site, reason)
    per_site: Counter = field(default_factory=Counter)
    warned: set = field(default_factory=set)
    # running totals (cheap to read every step, unlike summing the lists above)
    # frame_compile_s: torch.compile's frame compiles (Dynamo, AOTAutograd and Kiln's backend in
    # them); nested_compile_s: the part of compile_s and load_s spent inside them
    totals: dict = field(
        default_factory=lambda: {
            "compile_s": 0.0,
            "load_s": 0.0,
            "execute_s": 0.0,
            "frame_compile_s": 0.0,
            "nested_compile_s": 0.0,
        }
    )
    step_s: deque = field(default_factory=lambda: deque(maxlen=256))  # recent step times
    last_step_t: float = 0.0  # when the last step ended (or the first began); 0: not known
    last_step_s: float | None = None  # the time of the step that ended last, if it had a start


_m = _Metrics()
_lock = threading.Lock()


def _free_lock_in_child() -> None:
    """A forked child has only the forking thread: another thread of the parent (a kernel build
    thread counting its build) may have held the lock at the fork, so the child takes a new one."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_free_lock_in_child)


def reset() -> None:
    global _m
    with _lock:
        _m = _Metrics()


def incr(name: str, n: int = 1) -> None:
    with _lock:
        _m.counters[name] += n


def fallback(op: str, n: int = 1) -> None:
    with _lock:
        _m.fallbacks[op] += n


@contextmanager
def fallbacks_counted() -> Iterator[dict[str, int]]:
    """The ATen fallbacks counted inside the block, per op (the dict is filled when it ends):
    what a cached compile stores, to count them again with :func:`fallbacks_again` on a hit."""
    with _lock:
        before = dict(_m.fallbacks)
    fell: dict[str, int] = {}
    try:
        yield fell
    finally:
        with _lock:
            now = dict(_m.fallbacks)
        fell.update({k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)})


def fallbacks_again(fell: dict[str, int]) -> None:
    """Count a cached compile's fallbacks (:func:`fallbacks_counted`) as its lowering did."""
    with _lock:
        for op, n in fell.items():
            _m.fallbacks[op] += n


def forced_sync(reason: str) -> None:
    with _lock:
        _m.syncs[reason] += 1
        _m.counters["forced_syncs"] += 1


def compiled(seconds: float, nodes: int) -> None:
    with _lock:
        _m.counters["graphs_compiled"] += 1
        _m.compile_s.append(seconds)
        _m.totals["compile_s"] += seconds
        _m.graph_sizes.append(nodes)


def loaded(seconds: float) -> None:
    with _lock:
        _m.load_s.append(seconds)
        _m.totals["load_s"] += seconds


def executed(seconds: float) -> None:
    with _lock:
        _m.counters["graphs_executed"] += 1
        _m.execute_s.append(seconds)
        _m.totals["execute_s"] += seconds


def frame_compiled(seconds: float, nested: float) -> None:
    """Compile mode: torch.compile spent ``seconds`` compiling frames (Dynamo, AOTAutograd and
    Kiln's backend), ``nested`` of them in Kiln's compiles and cache loads (counted in
    ``compile_s`` / ``load_s`` already)."""
    with _lock:
        _m.totals["frame_compile_s"] += seconds
        _m.totals["nested_compile_s"] += nested


def compile_wait_s(snap: dict) -> float:
    """The seconds a run has waited for compiles, from a :func:`snapshot` (or the counters
    ``kiln.observe`` publishes): Kiln's compiles and cache loads, torch.compile's frame compiles
    around them, and waits for kernel builds."""
    keys = ("compile_s", "load_s", "frame_compile_s")
    waited = sum(snap.get(k, 0.0) for k in keys) - snap.get("nested_compile_s", 0.0)
    return waited + snap.get("kernel_wait_us", 0) / 1e6


def traced(seconds: float) -> None:
    with _lock:
        _m.trace_s.append(seconds)


def recompile(site: str, reason: str, warn_after: int, advice: str) -> None:
    """A call site compiled a new graph for a reason other than its first call; ``advice``
    (:func:`kiln.runtime.steps.recompile_advice`) says what to do about it in the warning."""
    with _lock:
        _m.counters["recompiles"] += 1
        _m.recompiles.append((site, reason))
        _m.per_site[site] += 1
        n = _m.per_site[site]
        should_warn = n > warn_after and site not in _m.warned
        if should_warn:
            _m.warned.add(site)
    if should_warn:
        warnings.warn(
            f"Kiln recompiled {site} {n} times; last reason: {reason}. {advice}",
            RecompileWarning,
            stacklevel=3,
        )


def counters() -> dict:
    with _lock:
        return {
            **dict(_m.counters),
            "fallbacks": dict(_m.fallbacks),
            "syncs": dict(_m.syncs),
            "compile_s_total": sum(_m.compile_s),
            "execute_s_total": sum(_m.execute_s),
            "trace_s_total": sum(_m.trace_s),
            "graph_sizes": list(_m.graph_sizes),
            "recompile_reasons": list(_m.recompiles),
        }


def snapshot() -> dict:
    """What :mod:`kiln.observe` reads each step: counters, fallback total, running time totals and
    recent step times; O(1) in the length of the run (no list is copied or summed)."""
    with _lock:
        return {
            **_m.counters,
            "fallbacks": sum(_m.fallbacks.values()),
            **_m.totals,
            "step_s": list(_m.step_s),
            "last_step_s": _m.last_step_s,
        }


def get(name: str) -> int:
    with _lock:
        return _m.counters.get(name, 0)


def _fmt_times(xs: list[float]) -> str:
    if not xs:
        return "-"
    return (
        f"n={len(xs)} total={sum(xs) * 1e3:.1f}ms median={statistics.median(xs) * 1e3:.2f}ms "
        f"max={max(xs) * 1e3:.1f}ms"
    )


def report() -> str:
    with _lock:
        m = _m
        lines = ["Kiln metrics"]
        for k in sorted(m.counters):
            lines.append(f"  {k:<28} {m.counters[k]}")
        lines.append(f"  {'compile time':<28} {_fmt_times(m.compile_s)}")
        if m.totals["frame_compile_s"]:
            lines.append(
                f"  {'torch.compile frames':<28} total={m.totals['frame_compile_s'] * 1e3:.1f}ms "
                "(Dynamo, AOTAutograd and the compile time above within them)"
            )
        lines.append(f"  {'disk-cache load time':<28} {_fmt_times(m.load_s)}")
        lines.append(f"  {'execute time':<28} {_fmt_times(m.execute_s)}")
        lines.append(f"  {'wall time between cuts':<28} {_fmt_times(m.trace_s)}")
        if m.graph_sizes:
            lines.append(
                f"  {'graph sizes (nodes)':<28} min={min(m.graph_sizes)} max={max(m.graph_sizes)}"
            )
        if m.syncs:
            lines.append("  forced syncs:")
            for k, v in m.syncs.most_common():
                lines.append(f"    {k:<26} {v}")
        if m.fallbacks:
            lines.append("  ops run eagerly (fallback):")
            for k, v in m.fallbacks.most_common():
                lines.append(f"    {k:<26} {v}")
        if m.recompiles:
            by = defaultdict(list)
            for site, reason in m.recompiles:
                by[site].append(reason)
            lines.append("  recompiles:")
            for site, reasons in by.items():
                lines.append(f"    {site}: {len(reasons)} (last: {reasons[-1]})")
        return "\n".join(lines)


# -- step boundaries --------------------------------------------------------------------------
_step_hooks: list[Callable[[], None]] = []


def on_step(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every training step (``kiln.observe``: state publishing, TensorBoard,
    profiler steps).  Hooks must be cheap: they run on the step path."""
    if fn not in _step_hooks:
        _step_hooks.append(fn)


def remove_step_hook(fn: Callable[[], None]) -> None:
    if fn in _step_hooks:
        _step_hooks.remove(fn)


def step_began(t: float) -> None:
    """The first step (since start or :func:`reset`) began at ``t`` (``time.perf_counter()``):
    it gets a time too.  Ignored once a step has begun or ended."""
    with _lock:
        if not _m.last_step_t:
            _m.last_step_t = t


def before_step_end(fn: Callable[[], None]) -> None:
    """Call ``fn()`` as each step ends, before it is counted and the observers read the metrics
    (compile mode adds the step's frame-compile time)."""
    if fn not in _before_step_end:
        _before_step_end.append(fn)


def step_done() -> None:
    """A training step ended: count it, time it (from the previous step's end, or from the first
    step's start), run the hooks."""
    for fn in tuple(_before_step_end):
        fn()
    now = time.perf_counter()
    with _lock:
        _m.counters["steps"] += 1
        _m.last_step_s = now - _m.last_step_t if _m.last_step_t else None
        if _m.last_step_s is not None:
            _m.step_s.append(_m.last_step_s)
        _m.last_step_t = now
    for fn in tuple(_step_hooks):
        fn()


def end_open_step(fn: Callable[[], None]) -> None:
    """Register ``fn``, which ends a step still open when the run ends (compile mode ends a step
    only when the next one starts): :func:`run_ending` calls it once."""
    if fn not in _open_step_enders:
        _open_step_enders.append(fn)


@atexit.register
def run_ending() -> None:
    """The run is ending: end the step still open, so that it is counted and observed.  The
    observers call it before they close (and it runs at exit); it runs each ender once."""
    while _open_step_enders:
        _open_step_enders.pop()()


_before_step_end: list[Callable[[], None]] = []
_open_step_enders: list[Callable[[], None]] = []


# -- profiler ranges --------------------------------------------------------------------------
class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()
# Set by kiln.observe.ranges (imported with kiln): executor -> its graph function with a named range
# around each generated kernel and fallback, which the C++ executor runs while a profiler records.
profiled_runner: Callable[[Any], Callable] | None = None
_open_spans: dict[str, Any] = {}  # key -> (RecordFunction, its profiler session's token)
_parked: list[Any] = []  # ranges whose session stopped before they ended (close_span)
# Set by the lazy device's guard extension (kiln.frontends.lazy.device_guard): (this thread's
# profiler session token or None, whether a token is this thread's current session).
profiler_sessions: tuple[Callable[[], Any], Callable[[Any], bool]] | None = None


def profiling() -> bool:
    """Whether a ``torch.profiler`` session is recording (a module attribute read, ~0.06 us)."""
    return _profiler._is_profiler_enabled


def span(name: str) -> Any:
    """``with metrics.span("kiln::compile"):`` a named range in profiler traces (category
    ``cpu_op``, ~0.8 us) while a profiler runs; a shared no-op otherwise."""
    if _profiler._is_profiler_enabled:
        return _RecordFunctionFast(name)
    return _NO_SPAN


def open_span(key: str, name: str) -> None:
    """Begin a range that ends in another call (:func:`close_span`), e.g. the lazy device's
    recording of a step, from one cut to the next.  Only while a profiler runs, and only where
    :data:`profiler_sessions` can tell profiler sessions apart (see :func:`close_span`)."""
    if _profiler._is_profiler_enabled and key not in _open_spans and profiler_sessions:
        token = profiler_sessions[0]()
        if token is None:
            return
        rf = _RecordFunctionFast(name)
        rf.__enter__()
        _open_spans[key] = (rf, token)


def close_span(key: str) -> None:
    """End the range :func:`open_span` began under ``key``.  A range whose profiler session has
    stopped since is not ended while another session records: ending it writes its end time into
    the stopped session's freed records (heap corruption, a crash later); it is parked and ended
    once no profiler runs (ending is then a no-op for the profiler)."""
    if _open_spans:
        entry = _open_spans.pop(key, None)
        if entry is not None:
            rf, token = entry
            if profiler_sessions[1](token):
                rf.__exit__(None, None, None)
            else:
                _parked.append(rf)
    _end_parked()


def _end_parked() -> None:
    if _parked and profiler_sessions and profiler_sessions[0]() is None:
        while _parked:
            _parked.pop().__exit__(None, None, None)
