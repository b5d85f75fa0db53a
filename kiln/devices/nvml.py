"""Live GPU state through NVML (``pynvml``, from the ``nvidia-ml-py`` package), for ``kiln ls``
and ``kiln top``: memory in use, utilization, PCI bus id and the processes on each GPU.

Returns [] when ``pynvml`` is not installed or NVML does not initialize (no driver).  A query a
GPU does not support (NVMLError) leaves that field None for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuStatus:
    index: int
    name: str
    uuid: str | None
    memory_mib: int | None
    memory_used_mib: int | None
    utilization_pct: int | None
    pci_bus_id: str | None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, MiB used)


def text(value: object) -> str:
    """An NVML string (bytes in older pynvml) as str."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _query(nvml: Any, call: Callable[[Any], Any], handle: Any, index: int) -> Any:
    """``call(handle)``; None when the GPU does not support it (NVMLError)."""
    error = getattr(nvml, "NVMLError", Exception)
    try:
        return call(handle)
    except error as exc:
        log.debug("NVML %s for GPU %d: %s", getattr(call, "__name__", call), index, exc)
        return None


def _processes(nvml: Any, handle: Any, index: int) -> list[tuple[int, int | None]]:
    found: dict[int, int | None] = {}
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        if not hasattr(nvml, fn):
            continue
        for p in _query(nvml, getattr(nvml, fn), handle, index) or []:
            used = getattr(p, "usedGpuMemory", None)
            found[int(p.pid)] = int(used) // _MIB if isinstance(used, int) else None
    return sorted(found.items())


@contextmanager
def session() -> Iterator[Any]:
    """``pynvml``, initialized, for the body of the ``with``; None when pynvml is missing or NVML
    does not initialize (no driver).  An NVMLError escaping the body is logged and stops the
    query (the caller reports what it has: nothing); NVML is shut down at the end."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - a broken pynvml install means "no GPUs"
        yield None
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError when there is no driver
        log.debug("NVML unavailable: %s", exc)
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            log.debug("nvmlShutdown failed: %s", exc)


def gpu_status() -> list[GpuStatus]:
    """Every GPU NVML reports, with its current memory use, utilization and processes."""
    with session() as nv:
        if nv is None:
            return []
        try:
            return [_status(nv, i) for i in range(nv.nvmlDeviceGetCount())]
        except Exception as exc:  # noqa: BLE001 - NVMLError on count/handle/name: report no GPUs
            log.warning("NVML query failed: %s", exc)
            return []


def _status(nv: Any, i: int) -> GpuStatus:
    h = nv.nvmlDeviceGetHandleByIndex(i)
    mem = _query(nv, nv.nvmlDeviceGetMemoryInfo, h, i)
    util = _query(nv, nv.nvmlDeviceGetUtilizationRates, h, i)
    pci = _query(nv, nv.nvmlDeviceGetPciInfo, h, i)
    uuid = _query(nv, nv.nvmlDeviceGetUUID, h, i)
    return GpuStatus(
        index=i,
        name=text(nv.nvmlDeviceGetName(h)),
        uuid=text(uuid) if uuid is not None else None,
        memory_mib=int(mem.total) // _MIB if mem is not None else None,
        memory_used_mib=int(mem.used) // _MIB if mem is not None else None,
        utilization_pct=int(util.gpu) if util is not None else None,
        pci_bus_id=text(pci.busId) if pci is not None else None,
        processes=_processes(nv, h, i),
    )
