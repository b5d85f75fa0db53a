"""Data-parallel training on torch.distributed: launcher, kiln process group, rank helpers.

kiln run --nproc-per-node 2 train.py                 # the launcher (torchrun underneath)

import kiln.distributed as kd
kd.init_process_group()                              # gloo on CPU; "kiln" for the lazy device
model = DistributedDataParallel(model)               # compile mode: torch.compile(backend="kiln")
sync = kd.GradientSync(model)                        # lazy device: all-reduce in the step graph
kd.print0("loss", loss)                              # rank-0 logging
kd.save(state, path); kd.load(state, path)           # torch.distributed.checkpoint
"""

from __future__ import annotations

from kiln.distributed import checkpoint
from kiln.distributed.grad_sync import GradientSync
from kiln.distributed.process_group import KilnProcessGroup, register
from kiln.distributed.rank import (
    gather_metrics,
    init_process_group,
    is_rank0,
    print0,
    rank,
    world_size,
)

register()

__all__ = [
    "GradientSync",
    "KilnProcessGroup",
    "checkpoint",
    "gather_metrics",
    "init_process_group",
    "is_rank0",
    "print0",
    "rank",
    "register",
    "world_size",
]
