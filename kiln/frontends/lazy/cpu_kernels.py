"""Running an op the kiln device does not record on its CPU kernel (both recorders' eager
fallback), with an error that says so where PyTorch has no CPU kernel for it.

PyTorch implements some ops for accelerators only (``batch_norm_stats`` and the other kernels of
``nn.SyncBatchNorm``, CUDA's fused kernels): its error then names the CPU backend, which the
user never chose.  The kiln device runs such an op on the host, so it cannot run there."""

from __future__ import annotations

from typing import Any

# ops whose only users are nn.SyncBatchNorm's forward and backward
_SYNC_BATCH_NORM = frozenset(
    {
        "batch_norm_stats",
        "batch_norm_gather_stats",
        "batch_norm_gather_stats_with_counts",
        "batch_norm_elemt",
        "batch_norm_backward_reduce",
        "batch_norm_backward_elemt",
    }
)


def call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` on CPU values; an op without a CPU kernel raises a
    ``NotImplementedError`` that names the kiln device and, where known, what to use instead."""
    try:
        return func(*args, **kwargs)
    except NotImplementedError as e:
        if "with arguments from the 'CPU' backend" not in str(e):
            raise
        name = func._schema.name.split("::")[-1]
        hint = ""
        if name in _SYNC_BATCH_NORM:
            hint = (
                " It is one of nn.SyncBatchNorm's kernels, which PyTorch provides for CUDA only: "
                "on the kiln device use nn.BatchNorm (statistics per rank, as "
                "DistributedDataParallel keeps them without SyncBatchNorm)."
            )
        raise NotImplementedError(
            f"kiln: aten::{name} cannot run on the kiln device: PyTorch has no CPU kernel for it "
            f"(only accelerator backends implement it), and the kiln device runs the ops it does "
            f"not compile on their CPU kernels.{hint}"
        ) from e
