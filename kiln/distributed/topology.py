"""How one machine's cores and accelerators are split between its local workers.

Pure functions (no torch), shared by the launcher (``kiln run``) and the worker bootstrap.

    split_cpus([0, 1, 2, 3], 2)            -> [[0, 1], [2, 3]]
    split_cpus([0, 1], 4)                  -> [[0], [1], [0], [1]]   (oversubscribed: warned)
    worker_device_env({"NEURON_RT_VISIBLE_CORES": "0-31"}, 1, 2)
                                           -> {"NEURON_RT_VISIBLE_CORES": "16-31"}
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

# Variables through which a process is handed its accelerators (what kiln cluster's agent sets),
# in the order they are tried.  Each value is a comma-separated list; Neuron cores may use ranges.
DEVICE_VARS = ("NEURON_RT_VISIBLE_CORES", "CUDA_VISIBLE_DEVICES")


class TopologyError(ValueError):
    pass


def parse_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the cpuset / Neuron-core syntax)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise TopologyError(f"bad id list {text!r}: use e.g. 0-3,8") from None
        if b < a or a < 0:
            raise TopologyError(f"bad range {part!r} in {text!r}")
        out.extend(range(a, b + 1))
    if len(set(out)) != len(out):
        raise TopologyError(f"id list {text!r} names an id twice")
    return out


def format_list(ids: Sequence[int]) -> str:
    """Inverse of :func:`parse_list`, with runs folded into ranges."""
    parts: list[str] = []
    ids = list(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def available_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, which a container or a cluster
    task may have narrowed), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cpus(cpus: Sequence[int], nproc: int) -> list[list[int]]:
    """Give each of ``nproc`` workers a disjoint, contiguous block of ``cpus``.

    With more workers than cores no split can avoid sharing: worker ``i`` gets core
    ``cpus[i % len(cpus)]`` (see :func:`oversubscribed`).  Leftover cores go to the first workers.
    """
    if nproc < 1:
        raise TopologyError(f"need at least one worker, got {nproc}")
    if not cpus:
        raise TopologyError("no CPU cores to split")
    cpus = list(cpus)
    if nproc > len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(nproc)]
    base, extra = divmod(len(cpus), nproc)
    out, start = [], 0
    for i in range(nproc):
        n = base + (1 if i < extra else 0)
        out.append(cpus[start : start + n])
        start += n
    return out


def oversubscribed(cpus: Sequence[int], nproc: int) -> bool:
    return nproc > len(cpus)


def split_devices(ids: Sequence[int], nproc: int) -> list[list[int]]:
    """Accelerators are never shared: each worker gets ``len(ids) // nproc`` of them."""
    if len(ids) < nproc or len(ids) % nproc:
        raise TopologyError(
            f"{len(ids)} visible devices cannot be split evenly between {nproc} workers; "
            f"use --nproc-per-node {_divisors(len(ids))}"
        )
    k = len(ids) // nproc
    return [list(ids[i * k : (i + 1) * k]) for i in range(nproc)]


def _divisors(n: int) -> str:
    return " or ".join(str(d) for d in range(1, n + 1) if n % d == 0) or "1"


def worker_device_env(env: Mapping[str, str], local_rank: int, nproc: int) -> dict[str, str]:
    """The device variables of worker ``local_rank``: its share of each list in ``env``."""
    out: dict[str, str] = {}
    for var in DEVICE_VARS:
        raw = env.get(var)
        if raw is None or not raw.strip():
            continue
        ids = parse_list(raw)
        out[var] = format_list(split_devices(ids, nproc)[local_rank])
    return out
