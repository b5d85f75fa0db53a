"""Rerun the programs a fuzz log (``KILN_TEST_FUZZ_LOG``) recorded as mismatches, each alone
(``batch_only`` records: their batch, as one graph), and print what differs now::

    .venv/bin/python tests/fuzz/replay.py fuzz.jsonl [--modes compile,lazy]

A program that matches now prints ``ok``; the exit status is 1 when any still differs.
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
    return Program(inputs, list(spec["lines"]), list(spec["outputs"]), list(spec["families"]))


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
        elif "specs" in r:
            batch = [(_program(s), d) for s, d in zip(r["specs"], r["data_seeds"])]
        else:
            continue
        cases = [test_fuzz._prepare(p, d) for p, d in batch]
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
