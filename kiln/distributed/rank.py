"""Rank-aware helpers: process-group setup, rank-0 logging, metrics from every rank.

kd.init_process_group()          # backend from ``kiln run --backend`` (auto: gloo on CPU)
kd.print0("step", i, loss)       # only rank 0 prints
kd.gather_metrics()              # rank 0: [kiln.metrics.counters() of rank 0, 1, ...]
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kiln import metrics
from kiln.distributed import state


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_rank0() -> bool:
    return rank() == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushed: workers' output is interleaved by the launcher)."""
    if is_rank0():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def choose_backend(device: torch.device | str | None = None) -> str:
    """The backend for this worker: ``kiln run --backend`` unless "auto"; then "kiln" for the
    kiln device, NCCL when CUDA is usable, else gloo."""
    chosen = state.LAUNCH.get("backend", "auto")
    if chosen != "auto":
        return chosen
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "kiln":
        return "kiln"
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        return "nccl"
    return "gloo"


def init_process_group(
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout_s: float = 300.0,
) -> str:
    """``dist.init_process_group`` from the launcher's environment (env:// rendezvous), with
    :func:`choose_backend`'s backend; returns the backend used.  A collective that waits longer
    than ``timeout_s`` (a peer died) raises instead of hanging."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized; call kiln.distributed.init_process_group "
            "once per process (or not at all if the script initializes it itself)"
        )
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"no rank information ({', '.join(missing)} unset): start the script with "
            "`kiln run --nproc-per-node N script.py` (or torchrun)"
        )
    backend = backend or choose_backend(device)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return backend


def gather_metrics() -> list[dict] | None:
    """Every rank's ``kiln.metrics.counters()``, on rank 0 (None on the others)."""
    mine = metrics.counters()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out
