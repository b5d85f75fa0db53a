"""Stage 3 of the native recorder (docs/native_recorder.md): a step writes an updated storage's
new value into that storage's own buffer (a ``writeback``), so parameters, gradients and optimizer
state keep their addresses (``data_ptr()``) across steps, as in eager.  Every case compares the
values with eager's; the addresses are read through public API only."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture

import kiln
from kiln import metrics
from kiln.frontends.lazy import native

dev = kiln.device()

pytestmark = pytest.mark.usefixtures("native_device")


class _Odd(torch.nn.Module):
    """A Linear layer and odd parameters: a scalar, a size-0 matrix, a (3, 1, 5) block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 7)
        self.s = torch.nn.Parameter(torch.tensor(0.7))
        self.z = torch.nn.Parameter(torch.randn(0, 3))
        self.o = torch.nn.Parameter(torch.randn(3, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) * self.s
        return h.sum(1) + self.z.sum() + (self.o * self.o).mean()


# the optimizers' defaults (foreach on the CPU-less kiln device: PyTorch picks foreach for it)
OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for st in opt.state.values()
        for _, v in sorted(st.items())
        if isinstance(v, torch.Tensor) and v.device.type == "kiln"
    ]


def _ptrs(ts: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in ts if t.numel() > 0]  # (a size-0 buffer has no address)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_default_optimizers_update_parameters_and_state_in_place(name, set_to_none):
    ref = _Odd()
    lz = copy.deepcopy(ref).to(dev)
    opt_r, opt_l = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](lz.parameters())
    kiln.mark_step()
    params = list(lz.parameters())
    ptrs = None
    copies = 0
    for i in range(4):
        if i == 2:
            copies = metrics.get("input_update_copies")
            compiled = metrics.get("graphs_compiled") + metrics.get("cache_hits_disk")
        torch.manual_seed(10 + i)
        x = torch.randn(5, 6)
        for m, o, xx in ((ref, opt_r, x), (lz, opt_l, x.to(dev))):
            loss = m(xx).square().mean()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        kiln.mark_step()
        tensors = params + _state(opt_l)
        if not set_to_none:
            tensors += [p.grad for p in params]
        now = _ptrs(tensors)
        if ptrs is not None:  # from the second step on (the first makes the state)
            assert now == ptrs, f"step {i}: a buffer moved"
        ptrs = now
        for a, b in zip(ref.parameters(), lz.parameters()):
            torch.testing.assert_close(b.cpu(), a.detach())
            if not set_to_none:
                torch.testing.assert_close(b.grad.cpu(), a.grad)
    assert len(_state(opt_l)) >= len(params) or name == "sgd"
    for sa, sb in zip(opt_r.state.values(), opt_l.state.values()):
        for k, v in sa.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(sb[k].cpu(), v, msg=f"state {k}")
    # steady steps compute every parameter and state update into its own buffer (the memory
    # plan): nothing copied; zeroed gradients (a fill, not a pointwise kernel) may be copied in
    allowed = 0 if set_to_none else 2 * len(params)
    assert metrics.get("input_update_copies") - copies <= allowed
    # the steady step's graph is recognised and reused (not compiled or loaded again)
    assert metrics.get("graphs_compiled") + metrics.get("cache_hits_disk") == compiled


def test_an_updated_tensor_read_before_and_after_the_update():
    a0 = torch.randn(4, 3)
    a = a0.to(dev)
    ptr = a.data_ptr()
    ref = a0.clone()
    for _ in range(3):
        before = a * 2  # the old value
        a.add_(1.5)
        after = a * 3  # the new one
        kiln.mark_step()
        torch.testing.assert_close(before.cpu(), ref * 2)
        ref.add_(1.5)
        torch.testing.assert_close(after.cpu(), ref * 3)
        torch.testing.assert_close(a.cpu(), ref)
        assert a.data_ptr() == ptr


def test_aliases_and_views_of_an_updated_parameter_see_the_new_value():
    w0 = torch.randn(3, 5)
    w = torch.nn.Parameter(w0.to(dev))
    alias = w.detach()
    view = w.detach().t()
    row = w.detach()[1]
    ref = w0.clone()
    ptr = w.data_ptr()
    opt = torch.optim.SGD([w], lr=0.5)
    for _ in range(3):
        old_t = view * 1.0  # read through a view before the update
        (w * w).sum().backward()
        opt.step()
        opt.zero_grad()
        kiln.mark_step()
        torch.testing.assert_close(old_t.cpu(), ref.t())
        ref = ref - 0.5 * 2 * ref
        torch.testing.assert_close(w.detach().cpu(), ref)
        torch.testing.assert_close(alias.cpu(), ref)
        torch.testing.assert_close(view.cpu(), ref.t())
        torch.testing.assert_close(row.cpu(), ref[1])
        assert w.data_ptr() == ptr == alias.data_ptr()


def test_a_storage_updated_twice_in_one_step():
    a0 = torch.randn(7)
    a = a0.to(dev)
    ptr = a.data_ptr()
    ref = a0.clone()
    for _ in range(3):
        a.add_(1)
        mid = a.clone()
        a.mul_(2)
        kiln.mark_step()
        ref = ref + 1
        torch.testing.assert_close(mid.cpu(), ref)
        ref = ref * 2
        torch.testing.assert_close(a.cpu(), ref)
        assert a.data_ptr() == ptr


@pytest.mark.parametrize("how", ["copy", "times-one"])
def test_another_tensor_taking_the_old_value_of_an_updated_one(how):
    """``b`` takes ``a``'s old value and ``a`` is then updated: ``b`` must not see the update
    (``a``'s new value is not written over a buffer ``b`` shares; ``a * 1`` simplifies to ``a``)."""
    a0, b0 = torch.randn(2, 3), torch.randn(2, 3)
    a, b = a0.to(dev), b0.to(dev)
    ref_a = a0.clone()
    for _ in range(3):
        b.copy_(a if how == "copy" else a * 1)
        a.add_(1)
        kiln.mark_step()
        torch.testing.assert_close(b.cpu(), ref_a)
        ref_a = ref_a + 1
        torch.testing.assert_close(a.cpu(), ref_a)
        assert a.data_ptr() != b.data_ptr()


def test_zero_size_and_non_contiguous_updated_tensors():
    z = torch.zeros(0, 4).to(dev)
    nc0 = torch.randn(5, 4)
    nc = nc0.t().to(dev)  # (4, 5), strides of the transpose kept by .to
    ptr = nc.data_ptr()
    ref = nc0.t().clone()
    for _ in range(3):
        z.add_(1)
        nc.mul_(0.5)
        kiln.mark_step()
        ref = ref * 0.5
        assert z.cpu().shape == (0, 4)
        torch.testing.assert_close(nc.cpu(), ref)
        assert nc.data_ptr() == ptr


def test_a_step_never_writes_into_a_tensor_given_to_native_tensor():
    t = torch.randn(6)
    keep = t.clone()
    x = native.tensor(t)
    for _ in range(2):
        x.add_(1)
        kiln.mark_step()
    torch.testing.assert_close(t, keep)
    torch.testing.assert_close(native.cpu(x), keep + 2)


# -- writes through views: functional + write-back through the view chain (no forced sync) -------

VIEW_WRITES: dict[str, Callable] = {
    "select-copy": lambda x, y: x[:, 0].copy_(y[:, 1]),
    "slice-setitem": lambda x, y: x.__setitem__((slice(1, 3),), y[:2]),
    "transposed-slice-chain": lambda x, y: x.t()[1:3].mul_(3).add_(1),
    "diagonal-zero": lambda x, y: x.diagonal().zero_(),
    "view-slice": lambda x, y: x.view(-1)[3:9].mul_(-2),
    "unsqueeze-permute-select": lambda x, y: x.unsqueeze(0).permute(2, 0, 1)[1].sub_(y[0, 1]),
    "split-fill": lambda x, y: x.split(2, dim=1)[1].fill_(-1),
    "unbind-add": lambda x, y: x.unbind(0)[2].add_(100),
    "strided-slice": lambda x, y: x[::2, 1::2].add_(y[::2, : x.shape[1] // 2]),
    "size-0-slice": lambda x, y: x[2:2].add_(1),
}


@pytest.mark.parametrize("name", list(VIEW_WRITES))
def test_writes_through_views_are_recorded_and_seen_by_every_alias(name):
    torch.manual_seed(7)
    x, y = torch.randn(5, 5), torch.randn(5, 5)
    lx, ly = x.to(dev), y.to(dev)
    kiln.mark_step()
    alias, other_view = lx.detach(), lx.t()[0]
    before = lx * 1.0  # recorded before the write: the old value
    metrics.reset()
    writes = metrics.get("native_inplace_writes")
    want_before = x.clone()
    VIEW_WRITES[name](x, y)
    VIEW_WRITES[name](lx, ly)
    assert metrics.counters().get("forced_syncs", 0) == 0
    assert not metrics.counters().get("fallbacks")  # nothing ran on the values
    assert metrics.get("native_inplace_writes") > writes
    kiln.mark_step()
    torch.testing.assert_close(lx.cpu(), x)
    torch.testing.assert_close(alias.cpu(), x)
    torch.testing.assert_close(other_view.cpu(), x.t()[0])
    torch.testing.assert_close(before.cpu(), want_before)


def test_a_write_through_a_view_of_a_parameter_keeps_its_buffer():
    w0 = torch.randn(4, 3)
    w = w0.to(dev)
    kiln.mark_step()
    ptr = w.data_ptr()
    ref = w0.clone()
    for _ in range(3):
        w[1].mul_(2)
        w.t()[2].add_(0.5)
        kiln.mark_step()
        ref[1].mul_(2)
        ref.t()[2].add_(0.5)
        torch.testing.assert_close(w.cpu(), ref)
        assert w.data_ptr() == ptr


def test_writes_through_views_without_an_inverse_run_on_the_values():
    """``unfold`` has no inverse rule: the write runs on the values (counted), still eager's
    result; a write through ``expand`` raises eager's error."""
    x = torch.randn(6, 3)
    lx = x.to(dev)
    metrics.reset()
    x.unfold(0, 2, 2).mul_(2)
    lx.unfold(0, 2, 2).mul_(2)
    assert metrics.counters()["fallbacks"].get("mul_") == 1
    torch.testing.assert_close(lx.cpu(), x)
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.randn(1, 3).expand(4, 3).add_(1)
    with pytest.raises(RuntimeError, match="single memory location"):
        lx[:1].expand(4, 3).add_(1)


def test_a_write_through_a_view_of_a_non_contiguous_base():
    x = torch.randn(4, 6).t()  # (6, 4), column-major
    lx = x.to(dev)
    assert lx.stride() == x.stride()
    lx[1:4, 2].mul_(-1)
    x[1:4, 2].mul_(-1)
    torch.testing.assert_close(lx.cpu(), x)
    assert lx.stride() == x.stride()
