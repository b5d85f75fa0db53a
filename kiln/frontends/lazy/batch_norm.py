"""``native_batch_norm`` in training mode on the kiln device: the running statistics it writes.

ATen's ``native_batch_norm`` updates ``running_mean`` and ``running_var`` in place when it
normalizes over the batch (``training=True``), but its schema does not mark them as written
(``Tensor? running_mean``, not ``Tensor(a!)``, unlike ``_native_batch_norm_legit``).  The
recorders took it for a pure op: the update happened only as a side effect of running the
recorded node on the buffers.  So a batch norm whose output nothing used (a statistics warm-up
loop, ``torch.optim.swa_utils.update_bn``) was pruned with its update, and one whose output was
read before ``mark_step()`` ran twice, once in the forced read and once in the step: the
statistics moved two momentum steps (found trying ``nn.BatchNorm1d`` as a new user would).

Here the call is recorded as ``_native_batch_norm_legit_functional`` (ATen's functional form of
the same kernel: the same outputs, and the new statistics as two more) and the new statistics are
copied into the buffers, an in-place write like any other: the update is part of the step whether
or not the output is used, and happens once.  ``InstanceNorm`` with ``track_running_stats``,
which batch-normalizes repeated statistics and averages them back, reads the written ones.
Evaluation mode and calls without running statistics are recorded as before.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def native_batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    if not training or running_mean is None or running_var is None:
        return NotImplemented  # writes nothing: recorded as the op itself
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


DECOMPOSITIONS: dict[Any, Any] = {
    aten.native_batch_norm.default: native_batch_norm,
}
