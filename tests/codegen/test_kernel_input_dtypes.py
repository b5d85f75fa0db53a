"""A generated kernel checks its tensor inputs' dtypes against its graph on every call.

A kernel's C++ reads each input as the dtype the graph says.  Where an ATen call in the graph
returns another dtype than torch's shape function said (ATen's CPU batch norm of a bf16 input
with float32 parameters returns float32 statistics, torch's meta says bf16), the kernel read the
memory as the wrong type: garbage gradients, silently (tests/frontends/
test_compile_mixed_dtype_norms.py has that case, fixed at its source).  Now such a call raises,
naming the kernel, the input and both dtypes, in the native launcher and in the Python executor.
The test re-creates the mismatch by putting back torch's decomposition of the batch-norm
backward, which reads the statistics at the graph's dtype.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions

import kiln
from kiln.frontends.compile import backend

BN_BACKWARD = torch.ops.aten.native_batch_norm_backward.default


def _batch_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, torch.zeros(16), torch.ones(16), w, b, training=True)


@pytest.mark.parametrize("launcher", [True, False], ids=["native_launcher", "python_executor"])
def test_a_kernel_input_of_another_dtype_than_the_graph_says_raises(
    launcher: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(backend._DECOMPS, BN_BACKWARD, core_aten_decompositions()[BN_BACKWARD])
    torch._dynamo.reset()
    x = torch.randn(4, 16, 10).bfloat16().requires_grad_()
    w = torch.ones(16, requires_grad=True)
    b = torch.zeros(16, requires_grad=True)
    with kiln.config.scoped(disk_cache=False, launcher=launcher):
        out = torch.compile(_batch_norm, backend="kiln")(x, w, b)
        with pytest.raises(RuntimeError) as raised:
            out.float().sum().backward()
    where, got, said = (
        (r"at node \d+", "Float", "BFloat16")
        if launcher
        else (r"kiln_[0-9a-f]{16}", "torch.float32", "torch.bfloat16")
    )
    message = (
        f": tensor input 0 is {got}, but the graph says {said} (an ATen call returned another "
        "dtype than torch's shape function said, a Kiln bug to report); KILN_BACKEND=interpreter "
        "runs the graph without generated kernels"
    )
    assert re.fullmatch(r"kiln kernel " + where + re.escape(message), str(raised.value)), str(
        raised.value
    )
    torch._dynamo.reset()


def test_matching_dtypes_run_as_before() -> None:
    # the same graph with float32 input: every kernel input is what the graph says
    torch._dynamo.reset()
    x = torch.randn(4, 16, 10, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    b = torch.zeros(16, requires_grad=True)
    with kiln.config.scoped(disk_cache=False):
        torch.compile(_batch_norm, backend="kiln")(x, w, b).sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    _batch_norm(x2, w2, b2).sum().backward()
    for got, want in ((x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()
