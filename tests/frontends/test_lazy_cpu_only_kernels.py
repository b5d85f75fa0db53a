"""An op PyTorch implements for accelerators only, reached on the kiln device (which runs the ops
it does not compile on their CPU kernels): an error that names the kiln device and, for
nn.SyncBatchNorm's kernels, what to use instead (it was PyTorch's "Could not run ... with
arguments from the 'CPU' backend", a backend the user never chose)."""

from __future__ import annotations

import pytest
import torch

import kiln


def test_an_op_without_a_cpu_kernel_names_the_kiln_device():
    x = torch.randn(3, 4, 5, device=kiln.device())
    with pytest.raises(NotImplementedError, match="cannot run on the kiln device") as info:
        torch.batch_norm_stats(x, 1e-5)
    assert "nn.SyncBatchNorm" in str(info.value) and "nn.BatchNorm" in str(info.value)
    kiln.mark_step()
    # the device goes on working
    y = (x * 2).sum()
    kiln.mark_step()
    assert torch.equal(y.cpu(), (x.cpu() * 2).sum())
