"""``kiln top``: a live view of the host's cores and every Kiln process, refreshed every second.

Views (keys): ``p`` processes (per-core bars and one row per Kiln process), ``g`` graphs (each
process's compiled graphs), ``d`` devices (``kiln ls``'s device table, live), ``a`` all of them;
``s`` cycles the sort order of processes (cpu, memory, step time, pid), ``q`` quits.  ``--once``
prints one frame (after a short sampling interval for the utilization figures) and exits.

Each frame reads ``/proc`` through psutil and the state records (:mod:`kiln.observe.records`);
nothing is asked of the training processes themselves.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from typing import Any

import psutil
from rich.console import Group
from rich.table import Table
from rich.text import Text

from kiln.devices.cpu import format_cpu_list
from kiln.observe import ls
from kiln.observe.inventory import inventory, process_info
from kiln.observe.records import read_records

VIEWS = ("processes", "graphs", "devices", "all")
SORTS = ("cpu", "memory", "step", "pid")
_KEYS = {"p": "processes", "g": "graphs", "d": "devices", "a": "all"}


def short_command(argv: list[str]) -> str:
    """``/venv/bin/python /home/me/train.py --lr 1`` -> ``python train.py --lr 1``."""
    return " ".join(os.path.basename(a) if "/" in a and a[:1] != "-" else a for a in argv)


class Top:
    def __init__(self, runtime_dir: str, root: str = "/", view: str = "processes") -> None:
        self.runtime_dir = runtime_dir
        self.root = root
        self.view = view
        self.sort = "cpu"
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(percpu=True)  # start the utilization interval

    def key(self, ch: str) -> bool:
        """Handle a key press; False to quit."""
        if ch in ("q", "\x03"):
            return False
        if ch in _KEYS:
            self.view = _KEYS[ch]
        elif ch == "s":
            self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        elif ch == "\t":
            self.view = VIEWS[(VIEWS.index(self.view) + 1) % len(VIEWS)]
        return True

    def _cpu_pct(self, pid: int) -> float | None:
        p = self._procs.get(pid)
        try:
            if p is None:
                p = self._procs[pid] = psutil.Process(pid)
                p.cpu_percent()  # first call starts the interval
                return None
            return p.cpu_percent()
        except psutil.Error:
            self._procs.pop(pid, None)
            return None

    def frame(self) -> Group:
        inv = inventory(self.root, self.runtime_dir) if self.view in ("devices", "all") else None
        if inv is None:
            procs = [process_info(r) for r in read_records(self.runtime_dir)]
        else:
            procs = inv["processes"]
        for p in procs:
            p["cpu_pct"] = self._cpu_pct(p["pid"])
        for gone in set(self._procs) - {p["pid"] for p in procs}:
            del self._procs[gone]
        parts: list[Any] = [self._header(procs)]
        if self.view in ("processes", "all"):
            parts += [self._cores(procs), Text(""), self._process_table(procs)]
        if self.view in ("graphs", "all"):
            parts += [Text(""), self._graphs_table(procs)]
        if self.view in ("devices", "all") and inv is not None:
            parts.append(Text(""))
            if inv["devices"]:
                parts.append(ls.device_table(inv, wide=True))
            else:
                parts.append(Text("no accelerators found (Neuron sysfs/devfs, NVML)"))
        parts.append(
            Text(
                f"\nview {self.view}, sort {self.sort} | keys: p processes  g graphs  "
                "d devices  a all  s sort  q quit",
                style="dim",
            )
        )
        return Group(*parts)

    def _header(self, procs: list[dict[str, Any]]) -> Text:
        vm = psutil.virtual_memory()
        load = os.getloadavg()
        return Text(
            f"kiln top - {socket.gethostname()} {time.strftime('%H:%M:%S')}  "
            f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}  "
            f"mem {ls.mib(vm.used // 2**20)} / {ls.mib(vm.total // 2**20)}  "
            f"{len(procs)} Kiln process{'es' if len(procs) != 1 else ''}",
            style="bold",
        )

    def _cores(self, procs: list[dict[str, Any]]) -> Table:
        t = Table(box=None, show_header=False, pad_edge=False)
        for _ in range(3):
            t.add_column()
        for cpu, pct in enumerate(psutil.cpu_percent(percpu=True)):
            bar = "#" * int(pct / 5 + 0.5)
            pids = [str(p["pid"]) for p in procs if cpu in p["cpus"]]
            t.add_row(
                f"cpu{cpu}",
                Text(f"[{bar:<20}] {pct:5.1f}%"),
                "kiln " + ",".join(pids) if pids else "",
            )
        return t

    def _sorted(self, procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keys = {
            "cpu": lambda p: -(p["cpu_pct"] or 0.0),
            "memory": lambda p: -(p["rss_mib"] or 0),
            "step": lambda p: -(p["step_s_last"] or 0.0),
            "pid": lambda p: p["pid"],
        }
        return sorted(procs, key=keys[self.sort])

    def _process_table(self, procs: list[dict[str, Any]]) -> Table:
        t = Table(box=None, header_style="bold reverse", pad_edge=False)
        cols = "PID CPU% RSS CPUS STEPS STEP_ms STEPS/s COMPILED CACHED GRAPHS RUNNING COMPILE_s "
        cols += "EXEC_s FALLBK SYNCS COMMAND"
        for col in cols.split():
            t.add_column(col.replace("_", " "), no_wrap=col != "COMMAND", overflow="ellipsis")
        now = time.time()
        for p in self._sorted(procs):
            c = p["counters"]
            step = p["step_s_last"]
            stale = p["updated"] is not None and now - p["updated"] > 5
            row = [
                str(p["pid"]),
                f"{p['cpu_pct']:.0f}" if p["cpu_pct"] is not None else "-",
                ls.mib(p["rss_mib"]),
                format_cpu_list(p["cpus"]),
                str(p["steps"]),
                f"{step * 1e3:.1f}" if step else "-",
                f"{1 / step:.1f}" if step else "-",
                str(c.get("graphs_compiled", 0)),
                str(c.get("cache_hits_disk", 0) + c.get("cache_hits_memory", 0)),
                str(len(p["graphs"])),
                f"{p['graphs_per_step']:g}" if p["graphs_per_step"] else "-",
                # every second waited for compiles (kiln.metrics.compile_wait_s); a record
                # written by an older Kiln has Kiln's own compile and load time only
                f"{p.get('compile_wait_s', c.get('compile_s', 0.0) + c.get('load_s', 0.0)):.2f}",
                f"{c.get('execute_s', 0.0):.2f}",
                str(c.get("fallbacks", 0)),
                str(c.get("forced_syncs", 0)),
                ("(idle) " if stale else "") + short_command(p["argv"]),
            ]
            t.add_row(*ls.cells(row))
        return t

    def _graphs_table(self, procs: list[dict[str, Any]]) -> Table:
        t = Table(box=None, header_style="bold reverse", pad_edge=False)
        for col in ("PID", "GRAPH", "NODES", "KERNELS", "FALLBACKS", "RUNS", "BACKEND"):
            t.add_column(col)
        for p in sorted(procs, key=lambda p: p["pid"]):
            for g in sorted(p["graphs"], key=lambda g: -g["runs"]):
                row = [
                    str(p["pid"]),
                    g["hash"][:16],
                    str(g["nodes"]),
                    str(g["kernels"]),
                    str(g["fallbacks"]),
                    str(g["runs"]),
                    g["backend"],
                ]
                t.add_row(*ls.cells(row))
        return t


def once(top: Top, sample_s: float) -> Group:
    """One frame, with utilization measured over ``sample_s`` seconds."""
    top.frame()  # starts the per-process intervals
    time.sleep(sample_s)
    return top.frame()


def live(top: Top, interval_s: float) -> None:
    """Refresh every ``interval_s`` until ``q`` (keys only when stdin is a terminal)."""
    from rich.live import Live

    tty = sys.stdin.isatty()
    saved = None
    if tty:
        import termios
        import tty as ttymod

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
        ttymod.setcbreak(fd)
    try:
        with Live(top.frame(), screen=True, auto_refresh=False) as view:
            while True:
                deadline = time.monotonic() + interval_s
                while (left := deadline - time.monotonic()) > 0:
                    if not tty:
                        time.sleep(left)
                        break
                    ready, _, _ = select.select([sys.stdin], [], [], left)
                    if ready:
                        if not top.key(os.read(sys.stdin.fileno(), 1).decode(errors="ignore")):
                            return
                        view.update(top.frame(), refresh=True)
                view.update(top.frame(), refresh=True)
    finally:
        if saved is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
