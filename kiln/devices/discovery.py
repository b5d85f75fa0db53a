"""Accelerator discovery: Neuron devices from sysfs/devfs, GPUs through NVML, or simulated.

Neuron: the driver publishes ``/sys/class/neuron_device/neuronN/core_count`` (NeuronCores on
chip N) and the device node ``/dev/neuronN``. A chip counts only when both exist. Optional files
``memory_mib`` (MiB of device memory) and ``info/architecture/device_name`` (e.g. "Trainium")
refine the record; without them the name and memory come from the core count's chip family.
``root`` prefixes every path so tests can point discovery at a fake tree.

GPUs: NVML through ``pynvml`` when it imports and initializes; otherwise none.

Simulated: the devices an instance type of ``kiln.devices.instances`` would have.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.devices import nvml
from kiln.devices.cpu import format_cpu_list
from kiln.devices.instances import lookup_instance_type

log = logging.getLogger(__name__)

_NEURON_DIR = re.compile(r"neuron(\d+)")
# Per-chip memory by chip name, for sysfs trees without a memory file.
_CHIP_MEMORY_MIB = {
    "inferentia": 8 * 1024,
    "inferentia2": 32 * 1024,
    "trainium": 32 * 1024,
    "trainium2": 96 * 1024,
}


@dataclass(frozen=True)
class Device:
    """One accelerator on the host."""

    kind: str  # "neuron" | "gpu"
    index: int  # 0 for /dev/neuron0 or GPU 0
    path: str | None  # "/dev/neuron0"; None for GPUs
    cores: int  # NeuronCores on the device (0 for GPUs)
    memory_mib: int
    name: str  # "trainium", or the GPU model name
    uuid: str | None = None  # GPU UUID when known


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _guess_chip(cores: int) -> str:
    # Inferentia has 4 NeuronCore-v1 per chip; Trainium and Inferentia2 have 2 NeuronCore-v2,
    # Trainium2 4 logical (8 physical) cores.
    return {4: "inferentia", 2: "trainium", 8: "trainium2"}.get(cores, "neuron")


def discover_neuron_devices(root: str = "/") -> list[Device]:
    """Neuron chips under ``root``: sysfs entries with a readable core_count and a /dev node."""
    base = Path(root)
    sysfs = base / "sys" / "class" / "neuron_device"
    try:
        entries = list(sysfs.iterdir())
    except OSError:
        return []
    devices: list[Device] = []
    for entry in entries:
        match = _NEURON_DIR.fullmatch(entry.name)
        if not match:
            continue
        index = int(match.group(1))
        node = base / "dev" / f"neuron{index}"
        if not node.exists():
            log.debug("skipping neuron%d: %s does not exist", index, node)
            continue
        cores = _read_int(entry / "core_count")
        if cores is None or cores <= 0:
            log.warning("skipping neuron%d: unreadable core_count under %s", index, entry)
            continue
        raw_name = _read_text(entry / "info" / "architecture" / "device_name")
        name = raw_name.lower() if raw_name else _guess_chip(cores)
        memory = _read_int(entry / "memory_mib")
        if memory is None:
            memory = _CHIP_MEMORY_MIB.get(name, 0)
        devices.append(Device("neuron", index, f"/dev/neuron{index}", cores, memory, name))
    return sorted(devices, key=lambda device: device.index)


def discover_gpus() -> list[Device]:
    """GPUs reported by NVML (pynvml); [] when pynvml is missing or NVML does not initialize."""
    with nvml.session() as nv:
        if nv is None:
            return []
        devices: list[Device] = []
        try:
            for index in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                name = nvml.text(nv.nvmlDeviceGetName(handle))
                gpu_uuid = nvml.text(nv.nvmlDeviceGetUUID(handle))
                memory = int(nv.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
                devices.append(Device("gpu", index, None, 0, memory, name, gpu_uuid))
        except Exception as exc:  # noqa: BLE001 - any NVMLError: report no GPUs
            log.warning("NVML query failed: %s", exc)
            return []
        return devices


def discover(root: str = "/") -> list[Device]:
    """Every accelerator on the host: Neuron chips under ``root``, then GPUs.

    NVML always describes the real host, so GPUs are only looked up when ``root`` is "/".
    """
    devices = discover_neuron_devices(root)
    if os.path.realpath(root) == os.path.realpath("/"):
        devices.extend(discover_gpus())
    return devices


def simulated_devices(instance_type: str) -> list[Device]:
    """The accelerators of a catalog instance type (16 Trainium chips for trn1.32xlarge).

    Simulated GPUs have no UUID (None), so consumers fall back to the index, which is what
    NVIDIA_VISIBLE_DEVICES needs if the host has real GPUs after all.
    Raises UnknownInstanceType (a ValueError) for a type that is not in the catalog.
    """
    itype = lookup_instance_type(instance_type)
    memory = itype.memory_per_device_mib
    name = itype.accelerator_name or ""
    if itype.accelerator_kind == "neuron":
        return [
            Device("neuron", index, path, itype.cores_per_device, memory, name)
            for index, path in enumerate(itype.device_paths())
        ]
    if itype.accelerator_kind == "gpu":
        return [
            Device("gpu", index, None, 0, memory, name) for index in range(itype.accelerator_count)
        ]
    return []


def neuron_core_ranges(devices: list[Device]) -> str:
    """NEURON_RT_VISIBLE_CORES for ``devices``: "0-31" for chips 0..15 with 2 cores each.

    Core ids are ``index * cores + k`` (all chips of a host have the same core count); contiguous
    runs become "a-b", single cores "a", joined by ",". GPUs are ignored; no devices gives "".
    """
    cores = sorted(
        {
            device.index * device.cores + offset
            for device in devices
            if device.kind == "neuron"
            for offset in range(device.cores)
        }
    )
    return format_cpu_list(cores)
