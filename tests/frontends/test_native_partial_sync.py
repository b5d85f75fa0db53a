"""A forced read on the kiln device (native recorder) computes only what it needs when that is
cheap (``native.peek``): the pending trace stays as it is and the step is still one graph at its
cut, as PyTorch/XLA syncs only the tensor read.  transformers reads ``bool(mask.all())`` early in
every forward; before, that cut the step in two.  A read that would recompute a GEMM, a random op,
a collective or an opaque ATen call cuts the whole trace, as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln
from kiln import metrics
from kiln.frontends.lazy import native

dev = kiln.device()
pytestmark = pytest.mark.usefixtures("native_device")


def _step(x: torch.Tensor, read: bool) -> tuple[torch.Tensor, bool | None]:
    pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    flag = None
    if read:
        flag = bool(((pos + 1).diff(dim=-1) == 1).all())  # a cheap closure: arange, add, diff
    return (x.exp() * 2 + pos).sum(-1), flag


def test_a_cheap_read_leaves_the_trace_and_the_step_graph_as_they_are():
    x = torch.randn(3, 9)
    lx = x.to(dev)
    kiln.mark_step()
    metrics.reset()
    out, _ = _step(lx, read=False)
    kiln.mark_step()
    whole = native.last_graph().hash
    torch.testing.assert_close(out.cpu(), _step(x, False)[0])

    metrics.reset()
    n0 = native.trace_len()
    out, flag = _step(lx, read=True)
    assert flag is True
    n1 = native.trace_len()
    assert n1 > n0  # the read ran no cut: what was recorded is still pending
    assert metrics.get("partial_syncs") == 1 and metrics.get("forced_syncs") == 1
    kiln.mark_step()
    torch.testing.assert_close(out.cpu(), _step(x, False)[0])
    # the step with the read is the same single graph (plus the read's small one)
    assert native.last_graph().hash == whole
    assert metrics.get("graphs_executed") == 2


def test_a_read_of_a_gemm_result_cuts_the_whole_trace():
    a, w = torch.randn(4, 8), torch.randn(8, 8)
    la, lw = a.to(dev), w.to(dev)
    kiln.mark_step()
    metrics.reset()
    y = (la @ lw).relu()
    v = y.sum().item()  # loss.item() before mark_step: recomputing the GEMM would cost a GEMM
    assert metrics.get("partial_syncs") == 0 and metrics.get("forced_syncs") == 1
    assert native.trace_len() == 0
    torch.testing.assert_close(torch.tensor(v), (a @ w).relu().sum())


def test_a_read_through_a_random_op_cuts_the_whole_trace_and_agrees_with_the_step():
    x = torch.ones(64, 8).to(dev)
    kiln.mark_step()
    metrics.reset()
    d = F.dropout(x, 0.5, training=True)
    n_kept = (d != 0).sum().item()
    assert metrics.get("partial_syncs") == 0
    kiln.mark_step()
    assert (d.cpu() != 0).sum().item() == n_kept  # one draw: the value read is the step's


def test_writes_after_a_read_and_values_read_twice():
    x = torch.randn(5, 6)
    lx = x.to(dev)
    kiln.mark_step()
    metrics.reset()
    y = lx * 2 + 1
    first = bool((y > -100).all())
    again = float(y.abs().max())
    y.add_(3)
    lx.mul_(0.5)
    kiln.mark_step()
    assert first and again == pytest.approx(float((x * 2 + 1).abs().max()))
    assert metrics.get("partial_syncs") == 2
    torch.testing.assert_close(y.cpu(), x * 2 + 4)
    torch.testing.assert_close(lx.cpu(), x * 0.5)


def test_a_read_of_a_value_that_is_not_pending_runs_no_graph():
    x = torch.randn(4)
    lx = x.to(dev)
    kiln.mark_step()
    pending = (lx * 3).sum()  # the trace is not empty
    metrics.reset()
    # Kiln's sum adds in another order than ATen's: within float32 rounding of sum(|x|)
    tol = 1e-6 * float(x.abs().sum())
    assert lx.sum().item() == pytest.approx(float(x.sum()), abs=tol)  # lx.sum(): a partial read
    assert metrics.get("graphs_executed") == 1 and metrics.get("partial_syncs") == 1
    torch.testing.assert_close(lx.cpu(), x)  # lx itself is not pending: no graph, no sync
    assert metrics.get("graphs_executed") == 1 and metrics.get("forced_syncs") == 1
    assert native.trace_len() > 0
    kiln.mark_step()
    assert pending.item() == pytest.approx(float(x.sum()) * 3, abs=3 * tol)


def test_item_of_a_value_that_is_there_needs_no_python_call():
    lx = torch.tensor(2.5).to(dev)
    kiln.mark_step()
    calls = native.python_ops().get("aten::_local_scalar_dense.default", 0)
    assert lx.item() == 2.5 and bool(lx) and int(lx.to(torch.int64).cpu()) == 2
    assert native.python_ops().get("aten::_local_scalar_dense.default", 0) == calls
    pending = lx * 2  # a pending value still goes through the fallback's (partial) read
    assert pending.item() == 5.0
    assert native.python_ops().get("aten::_local_scalar_dense.default", 0) == calls + 1


def test_a_read_of_a_graph_with_no_inputs_runs_once_and_is_reused():
    # transformers' per-step check of a mask built from sizes alone: the same small graph every
    # step, no input -- its values are kept after the first run
    def step(x: torch.Tensor, width: int) -> tuple[torch.Tensor, bool]:
        pos = torch.arange(width, device=dev)
        flag = bool((pos[1:] > pos[:-1]).all())
        return x * 2 + pos, flag

    x = torch.randn(5)
    lx = x.to(dev)
    kiln.mark_step()
    metrics.reset()
    for k in range(3):
        out, flag = step(lx, 5)
        assert flag is True
        kiln.mark_step()
        torch.testing.assert_close(out.cpu(), x * 2 + torch.arange(5))
    assert metrics.get("partial_syncs") == 3 and metrics.get("partial_syncs_reused") == 2
    # another size is another graph: computed, not taken from the first one
    metrics.reset()
    flag = bool((torch.arange(7, device=dev)[1:] < 3).all())
    assert flag is False and metrics.get("partial_syncs_reused") == 0
    kiln.mark_step()


def test_a_read_of_a_graph_with_inputs_is_computed_every_time():
    metrics.reset()
    for k in range(4):
        x = torch.randn(6) + (10.0 if k % 2 else -10.0)
        lx = x.to(dev)
        kiln.mark_step()
        pending = lx * 1.5
        assert bool((pending > 0).all()) is bool(k % 2)
        want = float((x * 1.5).sum()) + 1
        assert (pending.sum() + 1).item() == pytest.approx(
            want, abs=2e-6 * float(x.abs().sum()) + 1e-6
        )
        kiln.mark_step()
    assert metrics.get("partial_syncs") == 8 and metrics.get("partial_syncs_reused") == 0
