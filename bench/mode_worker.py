"""One benchmark mode in a process of its own, stepped by bench/run.py over a pipe.

    proc = ModeProcess("kiln", "gpt", a)     # starts ``python bench/mode_worker.py ...``
    proc.wait_ready()
    proc.steps(0, 3)                          # runs batches 0..2, appends their times/losses
    proc.dyn_graphs()                         # graphs compiled over ten sequence lengths
    proc.close()

Why a process per mode: a user trains with one mode per process.  Run side by side in one process
and stepped one step each in turn, the modes evict each other's weights, gradients and optimizer
state from the caches before every step (L2 is 1 MiB a core here), and share process-wide state
(glibc's malloc thresholds, which Kiln tunes; the OpenMP pool): every step is then a cold one, which
a training run's steady steps are not (measured: the first step of a block after another mode's
process ran took 1.5-2x the block's other steps).  bench/run.py keeps the modes interleaved in time
(rounds of a few steps each, the order rotating) so that the machine's noise still hits all of them,
and takes its medians over the steps of each block but the first.

The protocol is one JSON object per line: the worker writes ``{"ready": true, "error": ...}`` once
the workload and the mode's step are built, then answers each command (``{"cmd": "steps", "start":
i, "stop": j}``, ``{"cmd": "dyn"}``, ``{"cmd": "exit"}``).  The worker's own stdout is moved to its
stderr (a log file), so that prints of the libraries cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import IO, Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ModeProcess:
    """The parent's handle on one mode's worker process (bench/run.py)."""

    def __init__(self, mode: str, workload: str, a: argparse.Namespace) -> None:
        self.mode = mode
        self.times: list[float] = []
        self.counted: list[float] = []  # measured steps but the first of each block
        self.losses: list[float] = []
        self.graphs = 0
        self.error: str | None = None
        self.dyn: int | str | None = None
        # the worker's stderr: open for the worker's life, closed by close()
        self.log = tempfile.NamedTemporaryFile(prefix=f"kiln-bench-{mode}-", suffix=".log")  # noqa: SIM115
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--mode",
            mode,
            "--workload",
            workload,
            "--batches",
            str(a.warmup + a.steps),
            "--threads",
            str(a.threads),
            "--timeout",
            str(a.timeout),
            "--cache-dir",
            a.cache_dir,
        ] + (["--quick"] if a.quick else [])
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            with open(self.log.name, errors="replace") as f:
                tail = f.read()[-300:].strip().replace("\n", " ")
            raise RuntimeError(f"worker exited with {self.proc.returncode}: {tail}")
        return json.loads(line)

    def _ask(self, msg: dict) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            return self._read()
        except (OSError, RuntimeError) as e:
            self.error = self.error or f"error: {e}"
            return {}

    def wait_ready(self) -> None:
        try:
            self.error = self._read().get("error")
        except RuntimeError as e:
            self.error = f"error: {e}"

    def steps(self, start: int, stop: int, measured: bool = True) -> None:
        """Run batches ``start..stop-1``.  Of a measured block, all steps but the first count
        (:meth:`steady`): the first pays for the switch from another mode's process (its caches
        and its idle OpenMP threads), which steps of one training run do not."""
        if self.error:
            return
        r = self._ask({"cmd": "steps", "start": start, "stop": stop})
        if measured:
            times = r.get("times", [])
            self.counted += times[1:] if len(times) > 1 else times
        self.times += r.get("times", [])
        self.losses += r.get("losses", [])
        self.graphs += r.get("graphs", 0)
        self.error = self.error or r.get("error")

    def steady(self, warmup: int) -> list[float]:
        """The step times the medians are taken over (see :meth:`steps`)."""
        return self.counted

    def dyn_graphs(self) -> int | str | None:
        return self._ask({"cmd": "dyn"}).get("dyn_graphs", self.error)

    def close(self) -> None:
        if self.proc.poll() is None:
            self._ask({"cmd": "exit"})
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _serve(a: argparse.Namespace, out: IO[str]) -> None:
    from bench.run import Runner, _err, dynamic_graphs, set_up_process
    from bench.workloads import build

    def say(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    set_up_process(a.threads, a.cache_dir)
    try:
        wl = build(a.workload, a.quick, a.batches)
        runner = Runner(a.mode, wl, a.timeout)
    except Exception as e:  # noqa: BLE001 - reported in the table
        say({"ready": True, "error": _err(e)})
        return
    say({"ready": True, "error": runner.error})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "steps":
            n_times, n_losses, graphs = len(runner.times), len(runner.losses), runner.graphs
            for batch in wl.batches[msg["start"] : msg["stop"]]:
                runner.run(batch)
            say(
                {
                    "times": runner.times[n_times:],
                    "losses": runner.losses[n_losses:],
                    "graphs": runner.graphs - graphs,
                    "error": runner.error,
                }
            )
        elif msg["cmd"] == "dyn":
            say({"dyn_graphs": dynamic_graphs(wl, a.mode, a.timeout)})
        else:
            say({})
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--batches", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    out = os.fdopen(os.dup(1), "w")  # the protocol's channel
    os.dup2(2, 1)  # anything printed goes to the log
    sys.stdout = sys.stderr
    sys.path.insert(0, ROOT)
    _serve(a, out)


if __name__ == "__main__":
    main()
