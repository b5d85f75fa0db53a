"""Rerun the programs a fuzz log (``KILN_TEST_FUZZ_LOG``) recorded as mismatches, each alone
(``batch_only`` records: their batch, as one graph), and print what differs now::

    .venv/bin/python tests/fuzz/replay.py fuzz.jsonl [--modes compile,lazy,lazy-sizes]

A ``lazy-sizes`` record reruns its size sequence (the program at its own size, then at each other
size of its logged plan, in order, so the shape-generic graph is compiled and reused as in the
run).  A program that matches now prints ``ok``; the exit status is 1 when any still differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fuzz_programs import Input, Program


def _program(spec: dict) -> Program:
    inputs = [Input(i["name"], tuple(i["shape"]), i["role"], i["layout"]) for i in spec["inputs"]]
    return Program(
        inputs,
        list(spec["lines"]),
        list(spec["outputs"]),
        list(spec["families"]),
        [list(d) for d in spec.get("draws", [])],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--modes", default="compile,lazy")
    args = ap.parse_args()
    os.environ["KILN_TEST_FUZZ_MODES"] = args.modes
    import test_fuzz  # reads KILN_TEST_FUZZ_MODES at import

    still = 0
    with open(args.log) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for r in records:
        if "spec" in r:
            batch = [(_program(r["spec"]), r["data_seed"])]
            plans = [r.get("sizes")]
        elif "specs" in r:
            batch = [(_program(s), d) for s, d in zip(r["specs"], r["data_seeds"])]
            plans = r.get("sizes") or [None] * len(batch)
        else:
            continue
        cases = [test_fuzz._prepare(p, d, s) for (p, d), s in zip(batch, plans)]
        if any(c is None for c in cases):
            print("eager refuses this program now:\n" + batch[0][0].describe())
            continue
        bad = test_fuzz.check_cases(cases)
        for (p, d), b in zip(batch, bad):
            print(("\n".join(b) if b else "ok") + f"\n{p.describe()}# data_seed={d}\n")
        still += any(bad)
    print(f"{still} still differ")
    return 1 if still else 0


if __name__ == "__main__":
    sys.exit(main())
