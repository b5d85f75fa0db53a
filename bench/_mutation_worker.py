"""The formula-mutant worker of bench/mutation.py: one process runs many mutants.

It imports torch, Kiln and tests/kernels/test_formulas.py once, then for each request on stdin
(a JSON line: the mutant's index, the case names, the modes) puts the mutated formula table and
PRELUDE in place of the originals (``kiln.codegen.cpp.ops.FORMULAS`` entries, ``ops.PRELUDE`` and
the copy ``kiln.codegen.cpp`` imported), drops every compiled graph (the kernel cache is keyed by
the C++ source, so a mutated kernel is always rebuilt), and calls the CI test functions
``test_forward(name, mode)`` / ``test_backward(name, mode)`` of tests/kernels, with pytest's
semantics: a strict xfail that passes fails the run, one that raises is expected.  It answers one
line ``@@MUT {"ok": ..., "why": ...}``: ok (every test passed: the mutant survived) or the first
failing test.  Index -1 is the unmutated tree (a sanity run: must pass).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
sys.path.insert(0, str(ROOT / "bench"))

import test_formulas as tf
from mutation import OPS, formula_mutants

from kiln.codegen import cpp
from kiln.codegen.cpp import ops
from kiln.runtime.compiler import clear_memory_cache

FULL = dict(tf.ALL)
ORIG_FORMULAS = dict(ops.FORMULAS)
ORIG_PRELUDE = ops.PRELUDE


def apply(source: str | None) -> None:
    ops.FORMULAS.clear()
    ops.FORMULAS.update(ORIG_FORMULAS)
    prelude = ORIG_PRELUDE
    if source is not None:
        mod = types.ModuleType("kiln.codegen.cpp._mutant")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        ns = mod.__dict__
        exec(compile(source, str(ROOT / OPS), "exec"), ns)  # noqa: S102 - the mutant under test
        ns["Operand"] = ops.Operand  # the emitter's operands are instances of the original class
        ops.FORMULAS.update(ns["FORMULAS"])
        prelude = ns["PRELUDE"]
    ops.PRELUDE = cpp.PRELUDE = prelude
    clear_memory_cache()


def run_case(fn, name: str, mode: str, xfail: bool) -> str | None:
    """None when the test passes under pytest's rules, else why it fails."""
    test_id = f"tests/kernels/test_formulas.py::{fn.__name__}[{name}-{mode}]"
    try:
        fn(name, mode)
    except Exception as e:  # noqa: BLE001 - a failing test, reported
        if xfail:
            return None
        return f"{test_id}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if xfail:
        return f"{test_id}: XPASS(strict)"
    return None


def run(names: list[str], modes: list[str]) -> str | None:
    tf.ALL = {n: FULL[n] for n in names}
    tf.GRAD = [n for n in tf.ALL if tf.ALL[n].grad_inputs is not None]
    tf._RESULTS.clear()
    for mode in modes:
        for n in names:
            why = run_case(tf.test_forward, n, mode, n in tf.XFAIL)
            if why:
                return why
        for n in tf.GRAD:
            why = run_case(tf.test_backward, n, mode, n in tf.XFAIL or n in tf.GRAD_XFAIL)
            if why:
                return why
    return None


def main() -> None:
    muts = formula_mutants()
    for line in sys.stdin:
        req = json.loads(line)
        i = req["index"]
        names = req["cases"] or list(FULL)
        try:
            apply(None if i < 0 else muts[i].source)
            why = run(names, req["modes"])
        except Exception:  # noqa: BLE001 - e.g. the mutated module does not import
            why = "HARNESS ERROR: " + traceback.format_exc().splitlines()[-1]
        finally:
            apply(None)
        print("@@MUT " + json.dumps({"ok": why is None, "why": why or ""}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("KILN_DISK_CACHE", "1")
    main()
