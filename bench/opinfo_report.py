"""Run the whole OpInfo sweep (tests/conformance/test_opinfo.py) in both Kiln modes and report.

    python bench/opinfo_report.py                      # every op, both modes, fwd + grad
    python bench/opinfo_report.py --modes lazy --ops add,mul --json out.json
    python bench/opinfo_report.py --workers 0          # in this process (one op at a time)

Prints, per mode and check: passed / expected failures / unexpected failures / skipped, the
unexpected failures with their reason, expected-failure entries that now pass, the ops that fell
back to ATen (with counts), and the ops whose compile run reached no Kiln graph.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "conformance"))

import kiln  # noqa: E402
from opinfo_check import CHECKS, MODES, OPS  # noqa: E402
from opinfo_expected import expected_failure  # noqa: E402
from opinfo_pool import Sweep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--ops", default="", help="comma-separated op ids (default: all)")
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes (default: the usable CPUs, <= 4)",
    )
    ap.add_argument(
        "--json",
        default="",
        help="write every outcome to this file (and, as they come, to <file>l)",
    )
    ap.add_argument("--start", default="", help="begin at this op id (resume after a crash)")
    ap.add_argument("-v", "--verbose", action="store_true", help="name each op before it runs")
    a = ap.parse_args()
    kiln.config.update(cache_dir=tempfile.mkdtemp(prefix="kiln_opinfo_"))
    modes = a.modes.split(",")
    names = a.ops.split(",") if a.ops else list(OPS)
    if a.start:
        names = names[names.index(a.start) :]
    sweep = Sweep([(m, n) for m in modes for n in names], kiln.config.cache_dir, a.workers)
    rows = []
    t_all = time.perf_counter()
    for mode in modes:
        t0 = time.perf_counter()
        for name in names:
            if a.verbose:
                print(f"{mode} {name}", file=sys.stderr, flush=True)
            t = time.perf_counter()
            outs = sweep.result(mode, name)
            for check in a.checks.split(","):
                out = outs[check]
                status = out.status
                reason = expected_failure(name, mode, check)
                if status == "fail" and reason is not None:
                    status = "xfail"
                elif status == "pass" and reason is not None:
                    status = "xpass"
                rows.append(
                    dict(
                        op=name,
                        mode=mode,
                        check=check,
                        status=status,
                        detail=out.detail,
                        expected=reason,
                        fallbacks=out.fallbacks,
                        kiln_graphs=out.kiln_graphs,
                        seconds=time.perf_counter() - t,  # waited for it (workers overlap)
                    )
                )
                if a.json:  # one line per outcome as it comes: survives a crash
                    with open(a.json + "l", "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
        print(f"[{mode}] {len(names)} ops in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    sweep.close()
    report(rows)
    print(f"\ntotal time {time.perf_counter() - t_all:.1f}s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


def report(rows: list[dict]) -> None:
    by = defaultdict(Counter)
    for r in rows:
        by[(r["mode"], r["check"])][r["status"]] += 1
    print("mode     check  pass  xfail  xpass  FAIL  skip  considered")
    for (mode, check), c in sorted(by.items()):
        considered = c["pass"] + c["xfail"] + c["xpass"] + c["fail"]
        print(
            f"{mode:<8} {check:<5} {c['pass']:>5} {c['xfail']:>6} {c['xpass']:>6} "
            f"{c['fail']:>5} {c['skip']:>5} {considered:>11}"
        )
    fails = [r for r in rows if r["status"] == "fail"]
    if fails:
        print(f"\nUNEXPECTED FAILURES ({len(fails)}):")
        for r in fails:
            print(f"  {r['mode']}/{r['check']}/{r['op']}: {r['detail']}")
    xpass = [r for r in rows if r["status"] == "xpass"]
    if xpass:
        print(f"\nexpected failures that now pass ({len(xpass)}): remove them from the table")
        for r in xpass:
            print(f"  {r['mode']}/{r['check']}/{r['op']}")
    for mode in sorted({r["mode"] for r in rows}):
        fb: dict[str, set] = defaultdict(set)
        for r in rows:
            if r["mode"] == mode and r["status"] != "skip":
                for aten_op in r["fallbacks"]:
                    fb[aten_op].add(r["op"])
        print(f"\n[{mode}] ATen ops that fell back ({len(fb)}):")
        for aten_op, ops in sorted(fb.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(sorted(ops)[:6]) + (" ..." if len(ops) > 6 else "")
            print(f"  {aten_op:<40} {len(ops):>4} ops: {shown}")
    nog = sorted(
        {
            r["op"]
            for r in rows
            if r["mode"] == "compile" and r["status"] in ("pass", "xpass") and r["kiln_graphs"] == 0
        }
    )
    if nog:
        print(
            f"\n[compile] ops that passed without reaching a Kiln graph ({len(nog)}): "
            + ", ".join(nog)
        )


if __name__ == "__main__":
    main()
