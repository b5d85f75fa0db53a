"""What ``kiln ls`` lists, as one JSON-ready dict: the host's CPUs, accelerators and Kiln processes.

    {"host": ..., "cpu": {...sockets, cores, numa, caches, memory...},
     "devices": [{"id": "neuron0", "kind": "neuron", ..., "holders": [pid, ...]}, ...],
     "processes": [{"pid": ..., "cpus": [...], "devices": [...], "graphs": [...], ...}]}

Devices: Neuron chips from sysfs/devfs under ``root`` (:mod:`kiln.devices.discovery`), GPUs from
NVML (only for the real root: NVML describes this host).  Holders: a Kiln process holds the CPUs
of its affinity mask, the Neuron cores of its ``NEURON_RT_VISIBLE_CORES`` (or the chips of
``AWS_NEURON_VISIBLE_DEVICES``), the GPUs of its ``CUDA_VISIBLE_DEVICES``; NVML adds every
process it sees on a GPU, Kiln's or not.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import psutil

from kiln.devices.cpu import cpu_info, format_cpu_list, parse_cpu_list
from kiln.devices.discovery import discover_neuron_devices
from kiln.devices.nvml import gpu_status
from kiln.observe.publish import kiln_version
from kiln.observe.records import read_records


def _ids(text: str | None) -> set[int] | None:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; None when unset or not a list of numbers (e.g. UUIDs)."""
    if not text:
        return None
    try:
        return set(parse_cpu_list(text))
    except ValueError:
        return None


def process_info(rec: dict[str, Any]) -> dict[str, Any]:
    try:
        p = psutil.Process(rec["pid"])
        with p.oneshot():
            rss = p.memory_info().rss // (1024 * 1024)
            cpu_time = sum(p.cpu_times()[:2])
            status = p.status()
    except psutil.Error:
        rss, cpu_time, status = None, None, "gone"
    visible = rec.get("visible") or {}
    return {
        "pid": rec["pid"],
        "command": " ".join(rec.get("cmdline") or []),
        "argv": list(rec.get("cmdline") or []),
        "kiln_version": rec.get("kiln_version"),
        "status": status,
        "rss_mib": rss,
        "cpu_time_s": cpu_time,
        "cpus": rec.get("cpus", []),
        "threads": rec.get("threads"),
        "neuron_cores": visible.get("neuron_cores"),
        "neuron_devices": visible.get("neuron_devices"),
        "gpus": visible.get("gpus"),
        "task": (rec.get("task") or {}).get("arn"),
        "steps": rec.get("steps", 0),
        "step_s_last": rec.get("step_s_last"),
        "step_s_median": rec.get("step_s_median"),
        "graphs_per_step": rec.get("graphs_per_step"),
        "counters": rec.get("counters", {}),
        "graphs": rec.get("graphs", []),
        "updated": rec.get("updated"),
    }


def _neuron_holders(dev: Any, procs: list[dict[str, Any]]) -> list[int]:
    cores = set(range(dev.index * dev.cores, (dev.index + 1) * dev.cores))
    held = []
    for p in procs:
        want_cores, want_devs = _ids(p["neuron_cores"]), _ids(p["neuron_devices"])
        if (want_cores and want_cores & cores) or (want_devs and dev.index in want_devs):
            held.append(p["pid"])
    return held


def _gpu_holders(gpu: Any, procs: list[dict[str, Any]]) -> list[int]:
    held = {pid for pid, _ in gpu.processes}
    for p in procs:
        text = p["gpus"] or ""
        ids = _ids(text)
        if (ids and gpu.index in ids) or (gpu.uuid and gpu.uuid in text.split(",")):
            held.add(p["pid"])
    return sorted(held)


def inventory(root: str = "/", runtime_dir: str | None = None) -> dict[str, Any]:
    """Everything ``kiln ls`` shows.  ``root`` prefixes sysfs/procfs/devfs paths (tests)."""
    from kiln.config import config

    cpu = cpu_info(root)
    procs = [process_info(r) for r in read_records(runtime_dir or config.runtime_dir)]
    devices: list[dict[str, Any]] = []
    for d in discover_neuron_devices(root):
        devices.append(
            {
                "id": f"neuron{d.index}",
                **dataclasses.asdict(d),
                "core_ids": format_cpu_list(range(d.index * d.cores, (d.index + 1) * d.cores)),
                "holders": _neuron_holders(d, procs),
            }
        )
    if os.path.realpath(root) == os.path.realpath("/"):
        for g in gpu_status():
            devices.append(
                {
                    "id": f"gpu{g.index}",
                    "kind": "gpu",
                    **dataclasses.asdict(g),
                    "holders": _gpu_holders(g, procs),
                }
            )
    return {
        "host": socket.gethostname(),
        "kiln_version": kiln_version(),
        "cpu": {
            **dataclasses.asdict(cpu),
            "holders": {
                str(c): [p["pid"] for p in procs if c in p["cpus"]] for c in cpu.logical_cpus
            },
        },
        "devices": devices,
        "processes": procs,
    }
