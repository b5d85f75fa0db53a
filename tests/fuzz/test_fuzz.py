"""Differential fuzzer: random small programs, compile mode and the lazy device against eager.

CI runs a fixed-seed, small budget (``KILN_TEST_FUZZ_EXAMPLES``, default 25 programs), one
program per graph.  The long run is one command; it checks programs in batches
(``KILN_TEST_FUZZ_BATCH``), since compiling one program costs a Dynamo trace, an AOTAutograd
trace and a g++ build of its own, and most of that is fixed cost per graph::

    KILN_TEST_FUZZ_EXAMPLES=20000 KILN_TEST_FUZZ_BATCH=48 KILN_TEST_FUZZ_LOG=fuzz.jsonl \
        KILN_CACHE_DIR=~/.cache/kiln-fuzz .venv/bin/python -m pytest -q -p no:cacheprovider tests/fuzz

A batch is one function that runs its programs side by side (each program's own arguments and
outputs), compiled as one graph per mode; every program's outputs, gradients and updated inputs
are compared with its own eager run (float32 and float64, each program alone), exactly as for a
single program.  What batching changes: the programs of a batch share one graph, so Kiln's passes
may fuse kernels or eliminate common subexpressions across them and a kernel may hold pieces of
several programs; that checks more than one program per graph does, not less, but it is a
different graph from the single program's.  A batch that fails in a mode (a mismatch, an error, or
a whole graph left to ATen, which would hide its programs from Kiln) is bisected, half batches
down to single programs, so every mismatch is reported against the one program at fault (with its
data seed, to rerun it alone); a failure seen only in a batch is logged as ``batch_only`` with
the smallest batch that shows it.  Batches do not shrink; ``python tests/fuzz/replay.py LOG``
reruns every logged program (or batch) alone.

With ``KILN_TEST_FUZZ_LOG`` set, a mismatch is written to that file (program source, inputs,
what differed) and the run goes on; without it the first mismatch fails the test and hypothesis
shrinks it to a minimal program.  ``KILN_TEST_FUZZ_SEED`` picks another fixed seed;
``KILN_TEST_FUZZ_MODES`` (``compile,lazy``) the modes.  ``lazy-sizes`` is the lazy mode at several
sizes: each program runs on the lazy device at its own sizes and then at two or three other sizes
of its drawn dims (``fuzz_programs.size_plan``: every drawn size >= 2 shifted or doubled
consistently, tied dims together; a third of the programs also get a size 0 or 1 in between),
each compared with eager at that size, so the lazy device compiles a shape-generic graph for
the family and reuses it (``generic_graphs`` / ``generic_reuses`` in the stats).  It includes
the plain lazy check, so ``compile,lazy-sizes`` replaces ``compile,lazy``.  The lazy device keeps its
graph families for the whole process, so a program's own size may already be served by a
generic graph an earlier program of the same form made; replay.py reruns the logged program's
size sequence alone (a mismatch that needs the earlier programs does not replay).  The count of programs run and the seconds
spent per phase are printed at the end and logged.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import fuzz_harness
import pytest
import torch
from fuzz_harness import (
    Data,
    Near,
    Result,
    compare,
    make_batch_function,
    make_data,
    make_function,
    near_references,
    run,
    run_many,
)
from fuzz_programs import Program, programs, resized, size_plan
from hypothesis import HealthCheck, Phase, given, reject, seed, settings
from hypothesis import strategies as st

import kiln
from kiln import metrics

EXAMPLES = int(os.environ.get("KILN_TEST_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("KILN_TEST_FUZZ_SEED", "20261130"))
LOG = os.environ.get("KILN_TEST_FUZZ_LOG", "")
MODES = os.environ.get("KILN_TEST_FUZZ_MODES", "compile,lazy-sizes").split(",")
BATCH = max(1, int(os.environ.get("KILN_TEST_FUZZ_BATCH", "1")))

STATS = {
    "programs": 0,  # programs eager accepted, each checked in every mode of MODES
    "rejected": 0,
    "mismatches": 0,  # programs with a mismatch (any mode)
    "batch_only": 0,  # batches that failed while none of their programs fails alone
    "batch_reruns": 0,  # (batch, mode) pairs re-run program by program
    "compile_fallbacks": 0,
    "sizes_runs": 0,  # lazy-sizes: programs run at another size (each compared with eager)
    "sizes_skipped": 0,  # lazy-sizes: other sizes not run (no size >= 2, or eager refuses)
    "generic_graphs": 0,  # metrics over the lazy-sizes runs: shape-generic graphs compiled
    "generic_reuses": 0,  # ... and lazy graphs served by one
    "near_passes": 0,  # tensors that passed only on eager's typical error nearby (compare)
    "eager_s": 0.0,  # seconds spent per phase (references, then each mode incl. re-runs)
    "compile_s": 0.0,
    "lazy_s": 0.0,
    "lazy-sizes_s": 0.0,
}
_t0 = time.time()


def _rounded() -> dict:
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in STATS.items()}


def _log(record: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


@dataclass
class Case:
    prog: Program
    data_seed: int
    fn: Callable
    data: Data
    e32: Result
    e64: Result
    # lazy-sizes: the other sizes to run the program at ([drawn size, new size] pairs each)
    sizes: list[list[list[int]]] = field(default_factory=list)
    # eager's results at inputs next to ``data``, run when first asked (fuzz_harness.compare)
    near: Near | None = None


def _prepare(prog: Program, data_seed: int, sizes: list | None = None) -> Case | None:
    """Eager float32 and float64 references; None when eager refuses the program (e.g. autograd:
    a value saved for backward was updated in place): not a program the fuzzer checks.
    ``sizes``: the lazy-sizes plan (default: :func:`fuzz_programs.size_plan` of the seed)."""
    t0 = time.perf_counter()
    fn = make_function(prog)
    data = make_data(prog, data_seed)
    try:
        e32 = run(prog, fn, data)
        e64 = run(prog, fn, data, torch.float64)
    except (RuntimeError, IndexError, ValueError):
        return None
    finally:
        STATS["eager_s"] += time.perf_counter() - t0
    if sizes is None:
        sizes = size_plan(prog, data_seed) if "lazy-sizes" in MODES else []
    return Case(prog, data_seed, fn, data, e32, e64, sizes, near_references(prog, fn, data))


def _graph_fallbacks() -> int:
    return sum(v for k, v in metrics.counters()["fallbacks"].items() if k.startswith("graph:"))


def _sized_cases(cases: list[Case], k: int) -> list[tuple[int, Case]]:
    """The ``k``-th other size of each case that has one: (index in ``cases``, the program
    rebuilt at that size with its eager references, same data seed)."""
    out = []
    for i, c in enumerate(cases):
        if k >= len(c.sizes):
            continue
        prog = resized(c.prog, {a: b for a, b in c.sizes[k]})
        sized = None if prog is None else _prepare(prog, c.data_seed, [])
        if sized is None:
            STATS["sizes_skipped"] += 1
        else:
            out.append((i, sized))
    return out


def _check_sizes(cases: list[Case]) -> tuple[list[list[str]], bool]:
    """lazy-sizes: ``cases`` on the lazy device at their own sizes, then at each other size of
    their plans in turn (the same program at other sizes: the lazy device compiles a
    shape-generic graph at the first, reuses it later), each compared with eager at that
    size."""
    gen0, reuse0 = metrics.get("shape_generic_graphs"), metrics.get("shape_generic_reuses")
    bad, whole_fallback = _check_mode("lazy", cases, "lazy-sizes")
    for k in range(max((len(c.sizes) for c in cases), default=0)):
        sized = _sized_cases(cases, k)
        if not sized:
            continue
        STATS["sizes_runs"] += len(sized)
        got, fb = _check_mode("lazy", [c for _, c in sized], f"lazy-sizes[{k}]")
        whole_fallback |= fb
        for (i, _), g in zip(sized, got):
            moved = ",".join(f"{a}->{b}" for a, b in cases[i].sizes[k])
            bad[i] += [f"{m} (sizes {moved})" for m in g]
    STATS["generic_graphs"] += metrics.get("shape_generic_graphs") - gen0
    STATS["generic_reuses"] += metrics.get("shape_generic_reuses") - reuse0
    return bad, whole_fallback


def _check_mode(
    mode: str, cases: list[Case], label: str | None = None
) -> tuple[list[list[str]], bool]:
    """Run ``cases`` in ``mode`` (several: as one batch function, one graph); per case, what
    differed from eager (reported as ``label``, default the mode), and whether a whole graph
    went to ATen (Kiln checked nothing of it)."""
    if mode == "lazy-sizes":
        return _check_sizes(cases)
    label = label or mode
    progs, datas = [c.prog for c in cases], [c.data for c in cases]
    fn = cases[0].fn if len(cases) == 1 else make_batch_function(progs)
    gfb = _graph_fallbacks()
    try:
        if mode == "compile":
            torch._dynamo.reset()
            fb = sum(metrics.counters()["fallbacks"].values())
            got = run_many(progs, torch.compile(fn, backend="kiln", fullgraph=True), datas)
            STATS["compile_fallbacks"] += sum(metrics.counters()["fallbacks"].values()) - fb
        else:
            got = run_many(progs, fn, datas, device=kiln.device(), after=kiln.mark_step)
    except Exception as e:  # noqa: BLE001 - any error where eager works is a finding
        return [[f"{label}: raised {type(e).__name__}: {str(e)[:400]}"] for _ in cases], False
    near0 = fuzz_harness.COUNTS["near_passes"]
    bad = [compare(label, g, c.e32, c.e64, c.near) for g, c in zip(got, cases)]
    STATS["near_passes"] += fuzz_harness.COUNTS["near_passes"] - near0
    return bad, _graph_fallbacks() > gfb


def _bisect(mode: str, cases: list[Case], got: list[list[str]]) -> list[list[str]]:
    """``cases`` failed together in ``mode`` (``got``: a mismatch, an error, or a whole graph
    left to ATen): re-run each half as a batch, recursively, down to the programs at fault (a
    program whose batch went to ATen is so checked by Kiln after all).  A failure that vanishes
    when its batch is split is logged as ``batch_only`` with the smallest batch that shows it."""
    if len(cases) == 1:
        return got
    mid = len(cases) // 2
    out: list[list[str]] = []
    for part in (cases[:mid], cases[mid:]):
        g, whole_fallback = _check_mode(mode, part)
        out += _bisect(mode, part, g) if any(g) or whole_fallback else g
    if any(got) and not any(out):
        STATS["batch_only"] += 1
        _log(
            {
                "batch_only": sorted({m for b in got for m in b})[:20],
                "programs": [c.prog.describe() for c in cases],
                "specs": [asdict(c.prog) for c in cases],
                "data_seeds": [c.data_seed for c in cases],
                "sizes": [c.sizes for c in cases],
            }
        )
    return out


def check_cases(cases: list[Case]) -> list[list[str]]:
    """Check ``cases`` in every mode, as one batch (one graph per mode); per case, the
    mismatches found.  A batch that fails is bisected (:func:`_bisect`) to name the programs at
    fault."""
    bad: list[list[str]] = [[] for _ in cases]
    for mode in MODES:
        t0 = time.perf_counter()
        got, whole_fallback = _check_mode(mode, cases)
        if len(cases) > 1 and (whole_fallback or any(got)):
            STATS["batch_reruns"] += 1
            got = _bisect(mode, cases, got)
        for b, g in zip(bad, got):
            b += g
        STATS[f"{mode}_s"] += time.perf_counter() - t0
    STATS["programs"] += len(cases)
    for c, b in zip(cases, bad):
        if b:
            STATS["mismatches"] += 1
            _log(
                {
                    "mismatch": b,
                    "program": c.prog.describe(),
                    "spec": asdict(c.prog),
                    "data_seed": c.data_seed,
                    "sizes": c.sizes,
                }
            )
    if STATS["programs"] // 50 != (STATS["programs"] - len(cases)) // 50 or any(bad):
        _log({"stats": _rounded(), "seconds": round(time.time() - _t0, 1)})
    return bad


def _batches(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """BATCH draws of ``strategy`` (one: the same draws as a plain ``strategy``, so the CI seed
    keeps its programs)."""
    if BATCH == 1:
        return strategy.map(lambda x: [x])
    return st.lists(strategy, min_size=BATCH, max_size=BATCH)


@pytest.mark.filterwarnings("ignore::UserWarning")
@seed(SEED)
@settings(
    max_examples=-(-EXAMPLES // BATCH),
    deadline=None,
    database=None,
    derandomize=False,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
    # a failing batch was already bisected to its programs: shrinking the batch would re-run
    # dozens of batches for nothing
    phases=list(Phase) if BATCH == 1 else [Phase.explicit, Phase.generate],
)
@given(progs=_batches(programs()), data_seeds=_batches(st.integers(0, 2**16)))
def test_random_programs_match_eager(progs: list[Program], data_seeds: list[int]) -> None:
    cases = [_prepare(p, s) for p, s in zip(progs, data_seeds)]
    STATS["rejected"] += sum(c is None for c in cases)
    cases = [c for c in cases if c is not None]
    if not cases:
        reject()
    bad = check_cases(cases)
    if any(bad) and not LOG:
        raise AssertionError(
            "\n\n".join("\n".join(b) + "\n" + c.prog.describe() for b, c in zip(bad, cases) if b)
        )


def test_zz_fuzz_summary(record_property: Callable) -> None:
    """Reports (and logs) how many programs ran; fails if the budget produced too few valid ones
    (a generator that only makes programs eager refuses would check nothing).  The line is a
    ``summary`` property: tests/conftest.py prints it at the end of the run, also from an xdist
    worker (whose own output is not shown)."""
    if STATS["programs"] + STATS["rejected"] == 0:
        pytest.skip("the fuzz test did not run in this session (selected alone)")
    _log({"final": _rounded(), "seconds": round(time.time() - _t0, 1)})
    record_property("summary", f"fuzz: {_rounded()} in {time.time() - _t0:.0f} s")
    assert STATS["programs"] >= max(1, EXAMPLES // 2), STATS
