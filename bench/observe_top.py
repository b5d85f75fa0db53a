"""CPU used by a running ``kiln top`` (target: < 5% of one core), watching Kiln processes.

    python bench/observe_top.py [--seconds 30] [--trainers 1]

Starts ``--trainers`` small lazy-device training loops that publish their state into a private
runtime directory, then ``kiln top`` on a pseudo-terminal (live mode, one frame a second, as a
person runs it).  After its start-up (imports, up to the first frame, reported apart) it measures the CPU time ``kiln top``
used over ``--seconds`` of wall time, then quits it with ``q``.
"""

from __future__ import annotations

import argparse
import os
import pty
import select
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

TRAIN = textwrap.dedent(
    """
    import os, sys, time, torch, kiln
    torch.set_num_threads(1)
    dev = kiln.device()
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    x = torch.randn(16, 64).to(dev)
    while not os.path.exists(sys.argv[1]):
        m(x).square().mean().backward(); opt.step(); opt.zero_grad(); kiln.mark_step()
        time.sleep(0.05)
    """
)


def _wait_records(d: Path, n: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while len(list(d.glob("proc-*.json"))) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"trainers did not publish within {timeout_s} s")
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument(
        "--warmup", type=float, default=3.0, help="seconds after the first frame before measuring"
    )
    p.add_argument("--trainers", type=int, default=1)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-top-") as tmp:
        d = Path(tmp) / "run"
        stop = Path(tmp) / "stop"
        script = Path(tmp) / "train.py"
        script.write_text(TRAIN)
        env = {**os.environ, "KILN_RUNTIME_DIR": str(d), "COLUMNS": "160", "LINES": "50"}
        trainers = [
            subprocess.Popen([sys.executable, str(script), str(stop)], env=env)
            for _ in range(a.trainers)
        ]
        try:
            _wait_records(d, a.trainers)
            master, slave = pty.openpty()
            top = subprocess.Popen(
                [sys.executable, "-m", "kiln.tools.cli", "top"],
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env=env,
            )
            os.close(slave)
            drained = 0

            def drain(seconds: float) -> None:
                nonlocal drained
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    ready, _, _ = select.select([master], [], [], 0.2)
                    if ready:
                        drained += len(os.read(master, 65536))

            start = time.monotonic()
            while not drained and time.monotonic() - start < 300:  # start-up: imports
                drain(0.5)
            startup_cpu = sum(psutil.Process(top.pid).cpu_times()[:2])
            drain(a.warmup)
            proc = psutil.Process(top.pid)
            c0, t0 = proc.cpu_times(), time.monotonic()
            drain(a.seconds)
            c1, t1 = proc.cpu_times(), time.monotonic()
            os.write(master, b"q")
            top.wait(timeout=30)
            os.close(master)
        finally:
            stop.touch()
            for t in trainers:
                t.wait(timeout=60)
    used = (c1.user - c0.user) + (c1.system - c0.system)
    print(
        f"kiln top watching {a.trainers} Kiln process(es): {used:.2f} s CPU in {t1 - t0:.1f} s "
        f"= {used / (t1 - t0):.2%} of one core (target < 5%); start-up to the first frame "
        f"{startup_cpu:.2f} s CPU; {drained} bytes drawn; exit {top.returncode}"
    )


if __name__ == "__main__":
    main()
