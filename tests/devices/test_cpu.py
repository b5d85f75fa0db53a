"""CPU topology from a fake sysfs/procfs tree: sockets, cores, NUMA nodes, caches, memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.devices.cpu import Cache, NumaNode, cpu_info, format_cpu_list, parse_cpu_list


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_host(root: Path) -> None:
    """2 sockets x 2 cores x 2 threads = 8 CPUs; one NUMA node per socket; L1d/L1i/L2 per core,
    L3 per socket.  CPU n: socket n // 4, core (n // 2) % 2 (threads n and n^1 share a core)."""
    cpu = root / "sys/devices/system/cpu"
    _write(cpu / "online", "0-7")
    for n in range(8):
        socket, core = n // 4, (n // 2) % 2
        _write(cpu / f"cpu{n}/topology/physical_package_id", str(socket))
        _write(cpu / f"cpu{n}/topology/core_id", str(core))
        pair = f"{n & ~1}-{n | 1}"
        for i, (level, kind, size, shared) in enumerate(
            [
                (1, "Data", "48K", pair),
                (1, "Instruction", "32K", pair),
                (2, "Unified", "2048K", pair),
                (3, "Unified", "32M", f"{socket * 4}-{socket * 4 + 3}"),
            ]
        ):
            idx = cpu / f"cpu{n}/cache/index{i}"
            for name, value in (
                ("level", str(level)),
                ("type", kind),
                ("size", size),
                ("shared_cpu_list", shared),
            ):
                _write(idx / name, value)
    for node in range(2):
        d = root / "sys/devices/system/node" / f"node{node}"
        _write(d / "cpulist", f"{node * 4}-{node * 4 + 3}")
        _write(d / "meminfo", f"Node {node} MemTotal:       {64 * 1024 * 1024} kB")
    _write(root / "proc/meminfo", "MemTotal:       134217728 kB\nMemAvailable:   100663296 kB")
    _write(root / "proc/cpuinfo", "processor\t: 0\nmodel name\t: Fake Xeon 8488C\n")


def test_fake_two_socket_host(tmp_path: Path) -> None:
    fake_host(tmp_path)
    info = cpu_info(str(tmp_path))
    assert info.model == "Fake Xeon 8488C"
    assert info.logical_cpus == list(range(8))
    assert (info.sockets, info.cores) == (2, 4)
    assert info.numa == [
        NumaNode(0, [0, 1, 2, 3], 64 * 1024),
        NumaNode(1, [4, 5, 6, 7], 64 * 1024),
    ]
    assert info.caches == [
        Cache(1, "Data", 48, 4),
        Cache(1, "Instruction", 32, 4),
        Cache(2, "Unified", 2048, 4),
        Cache(3, "Unified", 32 * 1024, 2),
    ]
    assert (info.memory_mib, info.available_mib) == (128 * 1024, 96 * 1024)


def test_missing_files_leave_fields_unknown(tmp_path: Path) -> None:
    _write(tmp_path / "sys/devices/system/cpu/online", "0-3")
    info = cpu_info(str(tmp_path))
    assert info.logical_cpus == [0, 1, 2, 3]
    assert (info.sockets, info.cores, info.numa, info.caches) == (None, None, [], [])
    assert (info.model, info.memory_mib) == ("unknown", None)


def test_this_host() -> None:
    info = cpu_info()
    assert info.logical_cpus and info.memory_mib and info.memory_mib > 0


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,4,6-7", [0, 1, 4, 6, 7]), ("", [])],
)
def test_cpu_lists(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == text


def test_bad_cpu_list() -> None:
    with pytest.raises(ValueError):
        parse_cpu_list("0-x")
