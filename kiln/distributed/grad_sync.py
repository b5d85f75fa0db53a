"""Bucketed gradient all-reduce recorded into the lazy step graph.

    model.to(kiln.device())
    sync = kiln.distributed.GradientSync(model)          # after init_process_group
    loss = model(x).mean(); loss.backward()              # all-reduces are recorded during backward
    opt.step(); kiln.mark_step()                         # ...and run inside the step's graph

Parameters are grouped into buckets of about ``bucket_cap_mb`` (in reverse registration order,
roughly the order backward produces their gradients; one dtype per bucket).  When the last
gradient of a bucket has been accumulated (``register_post_accumulate_grad_hook``), the bucket is
flattened and its ``_c10d_functional.all_reduce`` recorded right there, between the backward ops
that follow; the matching ``wait_tensor`` and the copy back into each ``.grad`` are recorded when
backward ends (an autograd-engine callback).  Executed in recorded order, each bucket's
communication (gloo runs it on its own thread) overlaps the rest of backward.  Gradients are
averaged over the group (``average=False``: summed), like DistributedDataParallel.

Works on CPU tensors too (the collectives then run eagerly, asynchronously, as they are issued).
A parameter without a gradient in some step contributes zeros, so all ranks stay in step; it
then receives the averaged gradient of the ranks that had one (the sum over the group divided by
its size, as DistributedDataParallel with ``find_unused_parameters=True`` averages).  Each bucket
also carries a count per parameter of the ranks that had its gradient: a parameter that no rank
had a gradient for keeps ``grad`` None, as with DistributedDataParallel (an optimizer then skips
it: no weight decay, no moment update).  Telling that apart reads the counts on the host, a
forced sync on the lazy device, only in a step where this rank lacked a gradient.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from kiln import metrics


def _group_name(group: Any) -> str:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    name = dist.distributed_c10d._world.pg_names.get(pg)
    if name is None:
        raise RuntimeError("GradientSync: the process group is not registered with c10d")
    return name


def make_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``params`` per bucket: reverse order, one dtype each, <= cap (a parameter
    larger than the cap gets a bucket of its own)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    dtype = None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if cur and (p.dtype != dtype or size + nbytes > cap_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
        dtype = p.dtype
    if cur:
        buckets.append(cur)
    return buckets


class GradientSync:
    """Average gradients across the process group, bucketed, as part of each backward."""

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.Tensor],
        group: Any = None,
        bucket_cap_mb: float = 25.0,
        average: bool = True,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "GradientSync needs torch.distributed: call kiln.distributed.init_process_group() "
                "first (and start the script with `kiln run`)"
            )
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("GradientSync: no parameters that require grad")
        self.group = group
        self.group_name = _group_name(group)
        self.world = dist.get_world_size(group)
        self.average = average
        self.buckets = make_buckets(self.params, int(bucket_cap_mb * 1024 * 1024))
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def _reset(self) -> None:
        self._waiting = [len(b) for b in self.buckets]
        self._issued: list[Any] = [None] * len(self.buckets)
        self._armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks ----------------------------------------------------------------------------------
    def _ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._bucket_of[self._index[id(p)]]
        self._waiting[b] -= 1
        if self._waiting[b] == 0:
            self._issue(b)

    def _flat(self, b: int) -> torch.Tensor:
        """The bucket's gradients flattened (zeros for a missing one), then one element per
        parameter: 1 where this rank has its gradient, else 0 (summed: the ranks that had it)."""
        parts, had = [], []
        for i in self.buckets[b]:
            p = self.params[i]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(g.reshape(-1))
            had.append(p.grad is not None)
        p = self.params[self.buckets[b][0]]
        if all(had):  # the common case: a constant, so a lazy step's graph does not change
            parts.append(torch.ones(len(had), dtype=p.dtype, device=p.device))
        else:
            parts.append(torch.tensor(had, dtype=p.dtype, device=p.device))
        return torch.cat(parts)

    def _issue(self, b: int) -> None:
        flat = self._flat(b)
        self._issued[b] = torch.ops._c10d_functional.all_reduce(flat, "sum", self.group_name)
        metrics.incr("grad_buckets_issued")

    def _finish(self) -> None:
        try:
            for b in range(len(self.buckets)):
                if self._issued[b] is None:  # a parameter of it got no gradient this step
                    self._issue(b)
            with torch.no_grad():
                for b, idx in enumerate(self.buckets):
                    r = torch.ops._c10d_functional.wait_tensor(self._issued[b])
                    if self.average:
                        r = r / self.world
                    counts = r[r.numel() - len(idx) :]
                    missing = [k for k, i in enumerate(idx) if self.params[i].grad is None]
                    nobody = set()
                    if missing:  # a forced sync, only where this rank lacked a gradient
                        nobody = {k for k, c in zip(missing, counts[missing].tolist()) if c == 0}
                    off = 0
                    for k, i in enumerate(idx):
                        p = self.params[i]
                        chunk = r[off : off + p.numel()].view(p.shape)
                        off += p.numel()
                        if k in nobody:
                            continue  # no rank had a gradient: grad stays None
                        if p.grad is None:
                            p.grad = chunk.clone()
                        else:
                            p.grad.copy_(chunk)
        finally:
            self._reset()
