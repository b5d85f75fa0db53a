"""Device discovery over a fake sysfs/devfs tree, NVML stubs and the simulated catalog."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kiln.devices.discovery import (
    Device,
    discover,
    discover_gpus,
    discover_neuron_devices,
    neuron_core_ranges,
    simulated_devices,
)
from kiln.devices.instances import UnknownInstanceType


def fake_neuron(
    root: Path,
    index: int,
    cores: str | None = "2",
    node: bool = True,
    memory: str | None = None,
    name: str | None = None,
) -> None:
    entry = root / "sys" / "class" / "neuron_device" / f"neuron{index}"
    entry.mkdir(parents=True, exist_ok=True)
    if cores is not None:
        (entry / "core_count").write_text(cores + "\n")
    if memory is not None:
        (entry / "memory_mib").write_text(memory)
    if name is not None:
        arch = entry / "info" / "architecture"
        arch.mkdir(parents=True)
        (arch / "device_name").write_text(name + "\n")
    if node:
        (root / "dev").mkdir(exist_ok=True)
        (root / "dev" / f"neuron{index}").touch()


def test_trn1_32xlarge_tree(tmp_path: Path) -> None:
    for index in range(16):
        fake_neuron(tmp_path, index)
    devices = discover_neuron_devices(str(tmp_path))
    assert [d.index for d in devices] == list(
        range(16)
    )  # numeric order, not "neuron10" < "neuron2"
    assert devices[0] == Device("neuron", 0, "/dev/neuron0", 2, 32 * 1024, "trainium")
    assert devices[15].path == "/dev/neuron15"
    assert neuron_core_ranges(devices) == "0-31"


# (id, setup, expected devices)
TREES: list[tuple[str, list[dict[str, Any]], list[Device]]] = [
    ("empty-tree", [], []),
    (
        "device-node-missing-is-skipped",
        [{"index": 0}, {"index": 1, "node": False}],
        [Device("neuron", 0, "/dev/neuron0", 2, 32768, "trainium")],
    ),
    (
        "unreadable-core-count-is-skipped",
        [{"index": 0, "cores": "garbage"}, {"index": 1, "cores": None}, {"index": 2, "cores": "0"}],
        [],
    ),
    (
        "inferentia-by-core-count",
        [{"index": 3, "cores": "4"}],
        [Device("neuron", 3, "/dev/neuron3", 4, 8192, "inferentia")],
    ),
    (
        "name-and-memory-files-win",
        [{"index": 0, "cores": "2", "memory": "16384", "name": "Inferentia2"}],
        [Device("neuron", 0, "/dev/neuron0", 2, 16384, "inferentia2")],
    ),
    (
        "name-file-gives-memory",
        [{"index": 0, "cores": "4", "name": "Trainium2"}],
        [Device("neuron", 0, "/dev/neuron0", 4, 96 * 1024, "trainium2")],
    ),
]


@pytest.mark.parametrize(("setup", "expected"), [pytest.param(s, e, id=i) for i, s, e in TREES])
def test_fake_trees(tmp_path: Path, setup: list[dict[str, Any]], expected: list[Device]) -> None:
    (tmp_path / "sys" / "class" / "neuron_device").mkdir(parents=True)
    for spec in setup:
        fake_neuron(tmp_path, **spec)
    assert discover_neuron_devices(str(tmp_path)) == expected


def test_unrelated_sysfs_entries_are_ignored(tmp_path: Path) -> None:
    fake_neuron(tmp_path, 0)
    (tmp_path / "sys" / "class" / "neuron_device" / "power").mkdir()
    assert [d.index for d in discover_neuron_devices(str(tmp_path))] == [0]


def test_missing_sysfs_means_no_devices(tmp_path: Path) -> None:
    assert discover_neuron_devices(str(tmp_path / "nowhere")) == []


def test_discover_with_fake_root_skips_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_neuron(tmp_path, 0)
    monkeypatch.setattr(
        "kiln.devices.discovery.discover_gpus", lambda: pytest.fail("NVML is host-global")
    )
    assert [d.kind for d in discover(str(tmp_path))] == ["neuron"]


class _MemoryInfo:
    total = 80 * 1024 * 1024 * 1024


def _fake_pynvml(count: int, fail_init: bool = False) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: f"GPU-{h:04d}"  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: _MemoryInfo()  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


def test_discover_gpus_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml(2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert discover_gpus() == [
        Device("gpu", 0, None, 0, 81920, "NVIDIA H100 80GB HBM3", "GPU-0000"),
        Device("gpu", 1, None, 0, 81920, "NVIDIA H100 80GB HBM3", "GPU-0001"),
    ]
    assert fake.calls == ["init", "shutdown"]  # type: ignore[attr-defined]


def test_discover_gpus_when_nvml_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(2, fail_init=True))
    assert discover_gpus() == []


def test_discover_gpus_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes the import raise ImportError
    assert discover_gpus() == []


@pytest.mark.parametrize(
    ("instance_type", "count", "cores", "memory", "name", "ranges"),
    [
        ("trn1.32xlarge", 16, 2, 32768, "trainium", "0-31"),
        ("trn1.2xlarge", 1, 2, 32768, "trainium", "0-1"),
        ("trn2.48xlarge", 16, 4, 98304, "trainium2", "0-63"),
        ("inf1.6xlarge", 4, 4, 8192, "inferentia", "0-15"),
        ("inf2.24xlarge", 6, 2, 32768, "inferentia2", "0-11"),
    ],
)
def test_simulated_neuron(
    instance_type: str, count: int, cores: int, memory: int, name: str, ranges: str
) -> None:
    devices = simulated_devices(instance_type)
    assert len(devices) == count
    assert [d.path for d in devices] == [f"/dev/neuron{i}" for i in range(count)]
    assert {(d.kind, d.cores, d.memory_mib, d.name, d.uuid) for d in devices} == {
        ("neuron", cores, memory, name, None)
    }
    assert neuron_core_ranges(devices) == ranges


def test_simulated_gpus() -> None:
    devices = simulated_devices("p4d.24xlarge")
    assert devices == [Device("gpu", i, None, 0, 40960, "a100", None) for i in range(8)]
    assert [d.memory_mib for d in simulated_devices("g5.12xlarge")] == [24576] * 4


def test_simulated_unknown_type() -> None:
    with pytest.raises(UnknownInstanceType, match="x1.large"):
        simulated_devices("x1.large")


def neuron(index: int, cores: int = 2) -> Device:
    return Device("neuron", index, f"/dev/neuron{index}", cores, 32768, "trainium")


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([], ""),
        ([neuron(0)], "0-1"),
        ([neuron(3)], "6-7"),
        ([neuron(0), neuron(1), neuron(4)], "0-3,8-9"),
        ([neuron(5), neuron(4)], "8-11"),
        ([neuron(2, cores=1), neuron(4, cores=1)], "2,4"),
        ([neuron(0, cores=4), neuron(1, cores=4)], "0-7"),
        ([neuron(0), Device("gpu", 0, None, 0, 1, "a100")], "0-1"),
    ],
)
def test_neuron_core_ranges(devices: list[Device], expected: str) -> None:
    assert neuron_core_ranges(devices) == expected
