"""c10d's collective ops (``c10d::allgather_``, ``allreduce_``, ``broadcast_``, ...) on the
native recorder's tensors.

A ``ProcessGroup``'s C++ methods dispatch these ops: what ``DistributedDataParallel`` calls (its
parameter-shape check, its module-state broadcast, its reducer's bucket all-reduces).  PyTorch
registers their kernels per backend (CPU, CUDA, PrivateUse1: each picks the group's backend for
the tensors' device type) and no autograd kernel, leaving the autograd keys to each backend's
autograd fallback -- and PrivateUse2, the native tensors' key, has none: the call failed with
"Could not run 'c10d::allgather_' with arguments from the 'AutogradPrivateUse2' backend".

:func:`register` gives each c10d op that has a CPU kernel a fallthrough on ``AutogradPrivateUse2``
(collectives are not differentiable; what PyTorch's autograd fallback does for the other
backends) and a ``PrivateUse2`` kernel that runs it as the recorder's Python fallback runs any op
it does not take (``Handler.eager``): the pending step first (a forced sync, counted ``c10d``),
then the op on the CPU values of the native tensors -- their storages' buffers, so the
collective's in-place writes land in the tensors -- through the group's CPU backend (gloo); the
op's results that are those CPU values are handed back as the native tensors they came from.
Counted as a fallback under the op's name.
"""

from __future__ import annotations

from typing import Any

import torch


def _kernel(op: Any, handler: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return handler.eager(op, args, kwargs, "c10d")

    return kernel


def register(handler: Any) -> list[torch.library.Library]:
    """Register the kernels (module docstring); ``handler`` is the recorder's Python fallback
    (:class:`kiln.frontends.lazy.native.fallback.Handler`), whose ``eager`` runs an op on the
    values after the pending step, as for any op the recorder does not take.  The libraries, to
    keep alive."""
    lib = torch.library.Library("c10d", "IMPL")
    for qual in sorted(torch._C._dispatch_get_all_op_names()):
        if not qual.startswith("c10d::"):
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"):
            continue
        name = qual.split("::", 1)[1]
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.c10d, base), overload or "default")
        lib.impl(name, torch.library.fallthrough_kernel, "AutogradPrivateUse2")
        lib.impl(name, _kernel(op, handler), "PrivateUse2")
    return [lib]
