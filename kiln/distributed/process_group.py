"""The ``kiln`` process-group backend: torch.distributed on kiln (lazy) tensors.

    import kiln.distributed as kd
    kd.init_process_group(backend="kiln")         # or dist.init_process_group("kiln")
    dist.all_reduce(p.grad)                       # p.grad on kiln.device(): recorded in the step
    DistributedDataParallel(model.to(kiln.device()))

Registered with ``dist.Backend.register_backend``, as out-of-tree devices do.  PyTorch has no
Python constructor for a per-device ``c10d.Backend``, so this is a Python ``ProcessGroup`` that
serves every device of the group; it wraps a gloo group for the actual transport:

- CPU tensors go straight to gloo (``avg`` as sum then divide: gloo has no average);
- an all-reduce of kiln tensors is *recorded* into the lazy step graph as PyTorch's traceable
  functional collectives (``_c10d_functional.all_reduce`` + ``wait_tensor``) and copied back in
  place: it runs, through ATen and gloo, when the step's graph runs;
- every other collective on kiln tensors materializes them (a forced sync, counted in
  ``kiln.metrics``), runs on gloo and writes the result back.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from kiln import metrics

ReduceOp = dist.ReduceOp
_OP_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.PRODUCT: "product",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
}


def _is_lazy(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "kiln"


def _done(result: Any) -> dist.Work:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _op_of(opts: Any) -> Any:
    op = opts.reduceOp
    return getattr(op, "op", op)


class KilnProcessGroup(dist.ProcessGroup):
    """A process group for CPU and kiln tensors over gloo."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(
            dist.PrefixStore("kiln-gloo/", store), rank, size, timeout
        )

    def getBackendName(self) -> str:
        return "kiln"

    def name(self) -> str:
        return "kiln"

    def _name(self) -> str:
        """The name c10d registered this group under (what functional collectives resolve)."""
        name = dist.distributed_c10d._world.pg_names.get(self)
        if name is None:
            raise RuntimeError("kiln process group used before init_process_group registered it")
        return name

    # -- all-reduce --------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllreduceOptions()
        op = _op_of(opts)
        if op not in _OP_NAMES:
            raise ValueError(f"kiln process group: unsupported reduce op {op}")
        lazy = [t for t in tensors if _is_lazy(t)]
        if lazy and len(lazy) != len(tensors):
            raise ValueError("kiln process group: all_reduce of kiln and CPU tensors together")
        if lazy:
            for t in tensors:
                record_all_reduce(t, _OP_NAMES[op], self._name(), self.size())
            return _done(tensors)
        if op == ReduceOp.AVG:
            o = dist.AllreduceOptions()
            o.reduceOp = ReduceOp.SUM
            o.timeout = opts.timeout
            work = self._gloo.allreduce(tensors, o)
            n = self.size()

            def average(fut: torch.futures.Future) -> list[torch.Tensor]:
                fut.value()
                for t in tensors:
                    t.div_(n)
                return tensors

            return _create_work_from_future(work.get_future().then(average))
        return self._gloo.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        o = dist.AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
            o.timeout = opts.timeout
        works = [self.allreduce([t], o) for t in tensors]
        for w in works[:-1]:
            w.wait()
        return works[-1] if works else _done([])

    # -- everything else: gloo on CPU values ------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._on_cpu("broadcast", [tensors], opts or dist.BroadcastOptions())

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._on_cpu("allgather", [outputs, inputs], opts or dist.AllgatherOptions())

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        return self._on_cpu("_allgather_base", [output, input], opts or dist.AllgatherOptions())

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        return self._on_cpu(
            "reduce_scatter", [outputs, inputs], opts or dist.ReduceScatterOptions()
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        return self._on_cpu(
            "_reduce_scatter_base", [output, input], opts or dist.ReduceScatterOptions()
        )

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self._on_cpu("gather", [outputs, inputs], opts or dist.GatherOptions())

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        return self._on_cpu("scatter", [outputs, inputs], opts or dist.ScatterOptions())

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        return self._on_cpu(
            "alltoall_base",
            [output, input, output_split_sizes, input_split_sizes],
            opts or dist.AllToAllOptions(),
        )

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._on_cpu("send", [tensors, dst, tag], None)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._on_cpu("recv", [tensors, src, tag], None)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._gloo.barrier(opts or dist.BarrierOptions())

    def _on_cpu(self, name: str, args: list[Any], opts: Any) -> dist.Work:
        """Run gloo's ``name`` with every kiln tensor replaced by its CPU value; write back."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def swap(x: Any) -> Any:
            if isinstance(x, list):
                return [swap(y) for y in x]
            if _is_lazy(x):
                metrics.forced_sync(f"collective:{name}")
                c = x.cpu()
                pairs.append((x, c))
                return c
            return x

        cargs = [swap(a) for a in args]
        fn = getattr(self._gloo, name)
        work = fn(*cargs) if opts is None else fn(*cargs, opts)
        if not pairs:
            return work
        work.wait()
        for lazy, cpu in pairs:
            lazy.copy_(cpu)
        return _done([p[0] for p in pairs])


def record_all_reduce(t: torch.Tensor, op: str, group_name: str, size: int) -> torch.Tensor:
    """Record ``t = all_reduce(t, op)`` into the lazy step (functional collective + wait, copied
    back in place).  ``avg`` is recorded as a sum times ``1/size`` (gloo cannot average)."""
    fc = torch.ops._c10d_functional
    wire = "sum" if op == "avg" else op
    flat = t if t.is_contiguous() else t.contiguous()
    r = fc.wait_tensor(fc.all_reduce(flat, wire, group_name))
    if op == "avg":
        r = r / size
    t.copy_(r)
    metrics.incr("collectives_recorded")
    return t


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> KilnProcessGroup:
    return KilnProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``"kiln"`` a torch.distributed backend (idempotent)."""
    if "KILN" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("kiln", _create, devices=["cpu", "kiln"])
