"""The host's CPUs: sockets, cores, NUMA nodes, caches and memory, from sysfs and procfs.

Reads ``/sys/devices/system/cpu`` (online CPUs, each CPU's package and core id, its caches),
``/sys/devices/system/node`` (NUMA nodes: CPUs and memory) and ``/proc/meminfo`` /
``/proc/cpuinfo``.  ``root`` prefixes every path, so tests point it at a fake tree.  A file that
is missing leaves its field unknown (None or empty) rather than failing: containers often hide
parts of sysfs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Cache:
    level: int
    type: str  # "Data", "Instruction", "Unified"
    size_kib: int  # one instance
    instances: int  # how many of it the host has (one per core for L1/L2, per socket for L3)


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: list[int]
    memory_mib: int | None


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cpus: list[int]  # online CPU ids
    sockets: int | None
    cores: int | None  # physical cores
    numa: list[NumaNode] = field(default_factory=list)
    caches: list[Cache] = field(default_factory=list)
    memory_mib: int | None = None
    available_mib: int | None = None


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``; ValueError on anything else."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def format_cpu_list(cpus: list[int] | set[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"`` (the kernel's cpulist format)."""
    ordered = sorted(set(cpus))
    blocks: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        blocks.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(blocks)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _size_kib(text: str | None) -> int | None:
    """sysfs cache sizes: ``"32K"``, ``"1M"``; plain numbers are bytes."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)", text or "")
    if not m:
        return None
    value, unit = int(m.group(1)), m.group(2)
    return {"": value // 1024, "K": value, "M": value * 1024, "G": value * 1024 * 1024}[unit]


def _meminfo(text: str | None, key: str) -> int | None:
    m = re.search(rf"^(?:Node \d+ )?{key}:\s+(\d+) kB", text or "", re.MULTILINE)
    return int(m.group(1)) // 1024 if m else None


def _online(cpu_dir: Path) -> list[int]:
    text = _read(cpu_dir / "online")
    if text:
        try:
            return parse_cpu_list(text)
        except ValueError:
            pass
    found = sorted(int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*") if p.name[3:].isdigit())
    return found or list(range(os.cpu_count() or 1))


def _topology(cpu_dir: Path, cpus: list[int]) -> tuple[int | None, int | None]:
    packages: set[str] = set()
    cores: set[tuple[str, str]] = set()
    for c in cpus:
        topo = cpu_dir / f"cpu{c}" / "topology"
        pkg, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        if pkg is None or core is None:
            return None, None
        packages.add(pkg)
        cores.add((pkg, core))
    return len(packages), len(cores)


def _caches(cpu_dir: Path, cpus: list[int]) -> list[Cache]:
    seen: dict[tuple[int, str, int], set[str]] = {}
    for c in cpus:
        for index in sorted((cpu_dir / f"cpu{c}" / "cache").glob("index[0-9]*")):
            level, kind = _read(index / "level"), _read(index / "type")
            size = _size_kib(_read(index / "size"))
            if level is None or not level.isdigit() or kind is None or size is None:
                continue
            shared = _read(index / "shared_cpu_list") or f"cpu{c}"
            seen.setdefault((int(level), kind, size), set()).add(shared)
    return [Cache(lv, kind, size, len(groups)) for (lv, kind, size), groups in sorted(seen.items())]


def _numa(root: Path) -> list[NumaNode]:
    nodes: list[NumaNode] = []
    for d in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        cpulist = _read(d / "cpulist")
        try:
            cpus = parse_cpu_list(cpulist) if cpulist else []
        except ValueError:
            cpus = []
        nodes.append(NumaNode(int(d.name[4:]), cpus, _meminfo(_read(d / "meminfo"), "MemTotal")))
    return sorted(nodes, key=lambda n: n.id)


def _model(cpuinfo: str | None) -> str:
    m = re.search(
        r"^(?:model name|Model|cpu model|Processor)\s*:\s*(.+)$", cpuinfo or "", re.MULTILINE
    )
    return m.group(1).strip() if m else "unknown"


def cpu_info(root: str = "/") -> CpuInfo:
    """The CPUs of the host (or of the fake tree under ``root``)."""
    base = Path(root)
    cpu_dir = base / "sys/devices/system/cpu"
    cpus = _online(cpu_dir)
    sockets, cores = _topology(cpu_dir, cpus)
    meminfo = _read(base / "proc/meminfo")
    return CpuInfo(
        model=_model(_read(base / "proc/cpuinfo")),
        logical_cpus=cpus,
        sockets=sockets,
        cores=cores,
        numa=_numa(base),
        caches=_caches(cpu_dir, cpus),
        memory_mib=_meminfo(meminfo, "MemTotal"),
        available_mib=_meminfo(meminfo, "MemAvailable"),
    )
