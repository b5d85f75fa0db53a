"""``kiln ls``: the host's compute devices and the Kiln processes holding them, as tables."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from kiln.devices.cpu import format_cpu_list


def console() -> Console:
    """A console for tables: the terminal's width, or 160 columns into a pipe or file."""
    return Console(width=None if sys.stdout.isatty() else 160, highlight=False)


def cells(row: list[Any]) -> list[Any]:
    """Table cells as plain text: command lines and names must not be read as rich markup."""
    return [Text(c) if isinstance(c, str) else c for c in row]


def mib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value} MiB"


def _kib(value: int) -> str:
    return f"{value // 1024} MiB" if value >= 1024 and value % 1024 == 0 else f"{value} KiB"


def _cache_name(c: dict[str, Any]) -> str:
    suffix = {"Data": "d", "Instruction": "i"}.get(c["type"], "")
    return f"L{c['level']}{suffix}"


def _pids(pids: list[int]) -> str:
    return ",".join(str(p) for p in pids) or "-"


def summary(inv: dict[str, Any]) -> Text:
    cpu = inv["cpu"]
    n_numa = len(cpu["numa"])
    head = (
        f"kiln {inv['kiln_version']} on {inv['host']}: "
        f"{cpu['sockets'] if cpu['sockets'] is not None else '?'} socket(s), "
        f"{cpu['cores'] if cpu['cores'] is not None else '?'} cores, "
        f"{len(cpu['logical_cpus'])} logical CPUs ({format_cpu_list(cpu['logical_cpus'])}), "
        f"{n_numa} NUMA node{'s' if n_numa != 1 else ''}, {cpu['model']}"
    )
    caches = ", ".join(
        f"{_cache_name(c)} {_kib(c['size_kib'])} x{c['instances']}" for c in cpu["caches"]
    )
    mem = f"memory {mib(cpu['memory_mib'])} ({mib(cpu['available_mib'])} available)"
    return Text(head + "\n" + mem + ("; caches " + caches if caches else ""))


def numa_table(inv: dict[str, Any]) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("NUMA", "CPUS", "MEMORY", "KILN PROCESSES"):
        t.add_column(col)
    holders = inv["cpu"]["holders"]
    for node in inv["cpu"]["numa"]:
        pids = sorted({p for c in node["cpus"] for p in holders.get(str(c), [])})
        row = [
            f"node{node['id']}",
            format_cpu_list(node["cpus"]),
            mib(node["memory_mib"]),
            _pids(pids),
        ]
        t.add_row(*cells(row))
    return t


def device_table(inv: dict[str, Any], wide: bool) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False)
    cols = ["DEVICE", "KIND", "NAME", "CORES", "CORE IDS", "MEMORY", "USED", "UTIL", "HELD BY"]
    if wide:
        cols += ["OWNER PID", "COMMAND", "KILN"]
    for col in cols:
        t.add_column(col, overflow="fold")
    procs = {p["pid"]: p for p in inv["processes"]}
    for d in inv["devices"]:
        util = d.get("utilization_pct")
        row = [
            d["id"],
            d["kind"],
            d["name"],
            str(d.get("cores") or "-"),
            d.get("core_ids") or "-",
            mib(d.get("memory_mib")),
            mib(d.get("memory_used_mib")),
            f"{util}%" if util is not None else "-",
            _pids(d["holders"]),
        ]
        if wide:
            owner = next((procs[p] for p in d["holders"] if p in procs), None)
            row += [
                str(owner["pid"]) if owner else _pids(d["holders"]),
                owner["command"] if owner else "-",
                owner["kiln_version"] if owner else "-",
            ]
        t.add_row(*cells(row))
    return t


def _devices_of(p: dict[str, Any]) -> str:
    parts = []
    if p["neuron_cores"]:
        parts.append(f"neuron cores {p['neuron_cores']}")
    elif p["neuron_devices"]:
        parts.append(f"neuron {p['neuron_devices']}")
    if p["gpus"]:
        parts.append(f"gpu {p['gpus']}")
    return "; ".join(parts) or "cpu"


def process_table(inv: dict[str, Any], wide: bool) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False)
    cols = ["KILN PID", "CPUS", "THREADS", "DEVICES", "STEPS", "STEP ms", "GRAPHS", "RSS", "TASK"]
    if wide:
        cols += ["COMMAND", "KILN"]
    for col in cols:
        t.add_column(col, overflow="fold")
    for p in inv["processes"]:
        step = p["step_s_median"]
        row = [
            str(p["pid"]),
            format_cpu_list(p["cpus"]),
            str(p["threads"]),
            _devices_of(p),
            str(p["steps"]),
            f"{step * 1e3:.1f}" if step else "-",
            str(len(p["graphs"])),
            mib(p["rss_mib"]),
            p["task"] or "-",
        ]
        if wide:
            row += [p["command"], p["kiln_version"] or "-"]
        t.add_row(*cells(row))
    return t


def render(inv: dict[str, Any], wide: bool = False) -> Group:
    parts: list[Any] = [summary(inv), Text(""), numa_table(inv), Text("")]
    if inv["devices"]:
        parts += [device_table(inv, wide), Text("")]
    else:
        parts += [Text("no accelerators found (Neuron sysfs/devfs, NVML)"), Text("")]
    if inv["processes"]:
        parts.append(process_table(inv, wide))
    else:
        parts.append(Text("no Kiln processes running"))
    return Group(*parts)
