"""Differential fuzzer: random small programs, compile mode and the lazy device against eager.

CI runs a fixed-seed, small budget (``KILN_TEST_FUZZ_EXAMPLES``, default 25 programs).  The long
run is one command (the kernel cache in a fixed folder makes programs that differ only in shapes
or constants reuse their compiled kernels across runs)::

    KILN_TEST_FUZZ_EXAMPLES=20000 KILN_TEST_FUZZ_LOG=fuzz.jsonl KILN_CACHE_DIR=~/.cache/kiln-fuzz \
        .venv/bin/python -m pytest -q -p no:cacheprovider tests/fuzz

With ``KILN_TEST_FUZZ_LOG`` set, a mismatch is written to that file (program source, inputs,
what differed) and the run goes on; without it the first mismatch fails the test and hypothesis
shrinks it to a minimal program.  ``KILN_TEST_FUZZ_SEED`` picks another fixed seed; the count of
programs run is printed at the end and logged.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from fuzz_harness import compare, make_data, make_function, run
from hypothesis import HealthCheck, given, reject, seed, settings
from hypothesis import strategies as st
from fuzz_programs import Program, programs

import kiln
from kiln import metrics

EXAMPLES = int(os.environ.get("KILN_TEST_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("KILN_TEST_FUZZ_SEED", "20261130"))
LOG = os.environ.get("KILN_TEST_FUZZ_LOG", "")
MODES = os.environ.get("KILN_TEST_FUZZ_MODES", "compile,lazy").split(",")

STATS = {"programs": 0, "rejected": 0, "mismatches": 0, "compile_fallbacks": 0}
_t0 = time.time()


def _log(record: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


def check_program(prog: Program, data_seed: int) -> list[str]:
    """Run ``prog`` eagerly (float32, float64), compiled and lazily; the mismatches found."""
    fn = make_function(prog)
    data = make_data(prog, data_seed)
    try:
        e32 = run(prog, fn, data)
        e64 = run(prog, fn, data, torch.float64)
    except (RuntimeError, IndexError, ValueError):
        # eager refuses the program (e.g. autograd: a value saved for backward was updated in
        # place): not a program the fuzzer checks
        STATS["rejected"] += 1
        reject()
    STATS["programs"] += 1
    bad: list[str] = []
    if "compile" in MODES:
        torch._dynamo.reset()
        fb = sum(metrics.counters()["fallbacks"].values())
        try:
            got = run(prog, torch.compile(fn, backend="kiln", fullgraph=True), data)
            bad += compare("compile", got, e32, e64)
        except Exception as e:  # noqa: BLE001 - any error where eager works is a finding
            bad.append(f"compile: raised {type(e).__name__}: {str(e)[:400]}")
        STATS["compile_fallbacks"] += sum(metrics.counters()["fallbacks"].values()) - fb
    if "lazy" in MODES:
        try:
            got = run(prog, fn, data, device=kiln.device(), after=kiln.mark_step)
            bad += compare("lazy", got, e32, e64)
        except Exception as e:  # noqa: BLE001
            bad.append(f"lazy: raised {type(e).__name__}: {str(e)[:400]}")
    if bad:
        STATS["mismatches"] += 1
    if STATS["programs"] % 50 == 0 or bad:
        _log({"stats": dict(STATS), "seconds": round(time.time() - _t0, 1)})
    if bad:
        _log({"mismatch": bad, "program": prog.describe(), "data_seed": data_seed})
    return bad


@pytest.mark.filterwarnings("ignore::UserWarning")
@seed(SEED)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=False,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
@given(prog=programs(), data_seed=st.integers(0, 2**16))
def test_random_programs_match_eager(prog: Program, data_seed: int) -> None:
    bad = check_program(prog, data_seed)
    if bad and not LOG:
        raise AssertionError("\n".join(bad) + "\n" + prog.describe())


def test_zz_fuzz_summary(capsys) -> None:
    """Prints (and logs) how many programs ran; fails if the budget produced too few valid ones
    (a generator that only makes programs eager refuses would check nothing)."""
    if STATS["programs"] + STATS["rejected"] == 0:
        pytest.skip("the fuzz test did not run in this session (selected alone)")
    _log({"final": dict(STATS), "seconds": round(time.time() - _t0, 1)})
    with capsys.disabled():
        print(f"\nfuzz: {STATS} in {time.time() - _t0:.0f} s")
    assert STATS["programs"] >= max(1, EXAMPLES // 2), STATS
