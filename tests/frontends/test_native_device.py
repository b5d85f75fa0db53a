"""The kiln device with the native recorder as its recorder (``config.lazy_recorder = "native"``,
docs/native_recorder.md stage 2): factories, uploads, syncs, CPU operands, printing, storage
questions and saving, and results, gradients and updated parameters against eager."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from _native_testlib import native_device  # noqa: F401 - the module fixture
from _subprocess import run_json

import kiln
from kiln import metrics
from kiln.config import ConfigError
from kiln.frontends.lazy import native
from kiln.frontends.lazy.tensor import LazyTensor

dev = kiln.device()


pytestmark = pytest.mark.usefixtures("native_device")


def lazy(t: torch.Tensor) -> torch.Tensor:
    out = t.to(dev)
    assert native.is_native(out) and out.device == dev
    return out


def test_factories_make_native_tensors_with_eager_values():
    made = {
        "zeros": (torch.zeros(3, 2, device=dev), torch.zeros(3, 2)),
        "ones": (
            torch.ones(5, dtype=torch.float64, device=dev),
            torch.ones(5, dtype=torch.float64),
        ),
        "arange": (torch.arange(7, device=dev), torch.arange(7)),
        "full": (torch.full((2, 0), 1.5, device=dev), torch.full((2, 0), 1.5)),
        "eye": (torch.eye(3, 4, device=dev), torch.eye(3, 4)),
        "linspace": (torch.linspace(0, 1, 5, device=dev), torch.linspace(0, 1, 5)),
        "tensor": (torch.tensor([1.0, 2.0], device=dev), torch.tensor([1.0, 2.0])),
        "empty_shape": (torch.tensor([], device=dev), torch.tensor([])),
    }
    for name, (got, want) in made.items():
        assert native.is_native(got) and got.device == dev, name
        assert got.shape == want.shape and got.dtype == want.dtype, name
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=name)
    e = torch.empty(4, 3, device=dev)
    assert native.is_native(e) and e.shape == (4, 3)


def test_random_factories_are_seeded_nodes_reproducible_under_one_seed():
    """Random factories are graph nodes seeded from the step's seed input (stage 5's promise,
    test_native_random.py compares them with the Python recorder's): reproducible under
    ``manual_seed``, eager's shapes, dtypes and ranges, not eager's draws."""

    def draw():
        kiln.mark_step()
        torch.manual_seed(3)
        got = [
            torch.randn(4, 5, device=dev),
            torch.rand(3, device=dev),
            torch.randint(0, 9, (6,), device=dev),
        ]
        assert all(native.is_native(g) for g in got)
        assert native.trace_len() > 0  # recorded, not drawn at the call
        return [g.cpu() for g in got]

    got, again = draw(), draw()
    torch.manual_seed(3)
    want = [torch.randn(4, 5), torch.rand(3), torch.randint(0, 9, (6,))]
    for g, a, w in zip(got, again, want):
        torch.testing.assert_close(g, a, rtol=0, atol=0)
        assert g.shape == w.shape and g.dtype == w.dtype
    assert bool(((got[1] >= 0) & (got[1] < 1)).all())
    assert bool(((got[2] >= 0) & (got[2] < 9)).all())


def test_upload_is_copied_at_copy_time_and_needs_no_sync():
    kiln.mark_step()
    metrics.reset()
    src = torch.arange(6.0).reshape(2, 3)
    lx = lazy(src)
    ly = torch.zeros(2, 3, device=dev)
    ly.copy_(src * 2)
    src.fill_(-1.0)  # not seen by either
    assert metrics.counters().get("forced_syncs", 0) == 0
    torch.testing.assert_close(lx.cpu(), torch.arange(6.0).reshape(2, 3))
    torch.testing.assert_close(ly.cpu(), torch.arange(6.0).reshape(2, 3) * 2)


def _program(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    h = torch.relu(x @ w + 0.5)
    return [h, h.softmax(-1), h.sum(0), (x * 2 - 1).t().mean(1, keepdim=True), torch.exp(-x.abs())]


@pytest.mark.parametrize(
    "n,k,m", [(5, 7, 3), (1, 1, 1), (0, 4, 3), (6, 0, 2), (8, 16, 32)], ids=str
)
def test_results_match_eager_on_odd_and_zero_sizes(n, k, m):
    x, w = torch.randn(n, k), torch.randn(k, m)
    got = _program(lazy(x), lazy(w))
    kiln.mark_step()
    for g, want in zip(got, _program(x, w)):
        assert native.is_native(g) and g.shape == want.shape
        torch.testing.assert_close(g.cpu(), want, equal_nan=True)  # (means of nothing)


def test_non_contiguous_inputs_and_views_match_eager():
    base = torch.randn(7, 5)
    xt = base.t()  # non-contiguous upload
    sl = base[1::2, ::2]  # strided upload
    lb = lazy(base)
    got = [
        lazy(xt) * 3,
        lazy(sl) + 1,
        lb.t()[1:4] * 2,  # a view of a native tensor
        lb.expand(2, 7, 5).sum(0),
        lb[:, 2] - lb[:, 0],
    ]
    want = [xt * 3, sl + 1, base.t()[1:4] * 2, base.expand(2, 7, 5).sum(0), base[:, 2] - base[:, 0]]
    kiln.mark_step()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)


def test_mark_step_cuts_the_native_trace_and_chains_steps():
    x = torch.randn(4, 3)
    lx = lazy(x)
    y = lx * 2
    assert native.trace_len() > 0
    kiln.mark_step()
    assert native.trace_len() == 0
    z = y + lx  # reads the value the first step computed
    torch.kiln.synchronize()
    assert native.trace_len() == 0
    torch.testing.assert_close(native.cpu(z), x * 3)


def test_cpu_operands_follow_the_kiln_devices_rules():
    x = torch.arange(6.0).reshape(2, 3)
    lx = lazy(x)
    with pytest.raises(RuntimeError, match="found at least two devices, kiln:0 and cpu"):
        lx + torch.ones(3)
    torch.testing.assert_close((lx * torch.tensor(2.5)).cpu(), x * 2.5)  # 0-dim: allowed
    idx = torch.tensor([1, 0])
    torch.testing.assert_close(lx[idx].cpu(), x[idx])  # index tensors: allowed
    kiln.mark_step()
    torch.testing.assert_close((lx + 1).cpu(), x + 1)  # recording went on after the error


def test_print_item_and_data_dependent_ops_are_counted_syncs():
    metrics.reset()
    x = lazy(torch.tensor([3.0, 0.0, 1.5])) * 2
    assert "device='kiln:0'" in repr(x) and "6." in repr(x)
    assert metrics.counters()["syncs"]["print"] == 1
    assert x.sum().item() == 9.0
    idx = torch.nonzero(x * 1)
    torch.testing.assert_close(idx.cpu(), torch.tensor([[0], [2]]))
    c = metrics.counters()
    assert c["fallbacks"]["nonzero"] == 1 and c["syncs"]["op:nonzero"] == 1
    assert c["forced_syncs"] >= 3


def test_data_ptr_and_storage_are_the_host_buffers():
    x = torch.randn(4, 6)
    lx = lazy(x)
    v = lx[1]  # a view: the same host buffer
    assert lx.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert v.data_ptr() == lx.data_ptr() + 6 * 4
    other = lazy(x)
    assert other.untyped_storage().data_ptr() != lx.untyped_storage().data_ptr()
    y = lx * 2  # pending: asking runs the step
    metrics.reset()
    assert y.data_ptr() != 0
    assert metrics.counters()["syncs"]["storage"] == 1
    torch.testing.assert_close(native.cpu(y), x * 2)
    assert torch.ones(2).data_ptr() != 0  # other tensors unchanged


def test_save_writes_cpu_tensors_and_load_to_kiln_makes_native_ones(tmp_path):
    m = torch.nn.Linear(3, 4).to(dev)
    assert all(native.is_native(p) for p in m.parameters())
    w = (m.weight * 2).detach()  # pending at save time
    torch.save({"sd": m.state_dict(), "w": w}, tmp_path / "f.pt")
    got = torch.load(tmp_path / "f.pt", weights_only=True)
    assert got["w"].device.type == "cpu"
    torch.testing.assert_close(got["w"], native.cpu(m.weight) * 2)
    back = torch.load(tmp_path / "f.pt", map_location="kiln")
    assert native.is_native(back["w"])
    torch.testing.assert_close(back["w"].cpu(), got["w"])


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.LayerNorm(33), torch.nn.Linear(33, 5)
    )


def test_training_steps_match_eager_loss_grads_and_params():
    ref = _mlp()
    lz = copy.deepcopy(ref).to(dev)
    assert all(native.is_native(p) and isinstance(p, torch.nn.Parameter) for p in lz.parameters())
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_l = torch.optim.SGD(lz.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    for step in range(3):
        x, y = torch.randn(9, 16), torch.randint(0, 5, (9,))
        loss_r = torch.nn.functional.cross_entropy(ref(x), y)
        loss_r.backward()
        loss_l = torch.nn.functional.cross_entropy(lz(x.to(dev)), y.to(dev))
        loss_l.backward()
        kiln.mark_step()
        torch.testing.assert_close(loss_l.detach().cpu(), loss_r.detach(), msg=f"loss {step}")
        for (name, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            torch.testing.assert_close(pl.grad.cpu(), pr.grad, msg=f"grad {name} {step}")
        opt_r.step()
        opt_l.step()
        opt_r.zero_grad()
        opt_l.zero_grad()
        kiln.mark_step()
        for (name, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            assert native.is_native(pl)
            torch.testing.assert_close(pl.detach().cpu(), pr.detach(), msg=f"param {name} {step}")


def test_the_switch_is_per_call_and_checked():
    kiln.config.update(lazy_recorder="python")
    try:
        p = torch.ones(2, device=dev)
        assert type(p) is LazyTensor
    finally:
        kiln.config.update(lazy_recorder="native")
    n = torch.ones(2, device=dev)
    assert type(n) is torch.Tensor and native.is_native(n)
    with pytest.raises(RuntimeError, match="kiln"):
        n + p  # the two recorders' tensors do not mix
    kiln.mark_step()
    with pytest.raises(ConfigError, match="lazy_recorder"):
        kiln.config.update(lazy_recorder="c++")


# -- stage 3 (started): in-place ops on whole storages recorded as functional + write-back ----------


def test_inplace_on_a_whole_storage_is_recorded_without_a_sync():
    x = torch.randn(5, 3)
    lx = lazy(x)
    alias = lx.detach()  # the same storage
    row = lx[1]  # a view of it
    kiln.mark_step()
    metrics.reset()
    before = lx * 2  # recorded before the writes: reads the old value
    lx.add_(1.0).mul_(torch.tensor(3.0))
    lx.sub_(lazy(torch.ones(3)))  # broadcast operand
    after = lx + 0
    assert metrics.counters().get("forced_syncs", 0) == 0
    assert metrics.counters()["native_inplace_writes"] == 3
    kiln.mark_step()
    want = (x + 1) * 3 - 1
    torch.testing.assert_close(before.cpu(), x * 2)
    torch.testing.assert_close(after.cpu(), want)
    torch.testing.assert_close(lx.cpu(), want)
    torch.testing.assert_close(alias.cpu(), want)
    torch.testing.assert_close(row.cpu(), want[1])


@pytest.mark.parametrize("shape", [(0, 3), (1,), (7, 1, 5)], ids=str)
def test_inplace_keeps_dtype_and_matches_eager(shape):
    x = torch.randn(shape)
    y = torch.randn(shape, dtype=torch.float64)
    lx, ly = lazy(x), lazy(y)
    lx.add_(ly)  # float64 operand: the result stays float32, as in eager
    lx.clamp_(min=-0.5)
    lc = torch.zeros(shape, device=dev)
    lc.copy_(lx)  # native -> native copy_
    x.add_(y)
    x.clamp_(min=-0.5)
    kiln.mark_step()
    assert lx.dtype == torch.float32
    torch.testing.assert_close(lx.cpu(), x)
    torch.testing.assert_close(lc.cpu(), x)


def test_inplace_through_a_view_is_recorded_without_a_sync():
    x = torch.randn(4, 6)
    lx = lazy(x)
    kiln.mark_step()
    metrics.reset()
    y = lx * 1
    lx[:, 0].mul_(3)  # a view: written back through its chain (native/viewwrite.py)
    x[:, 0].mul_(3)
    assert metrics.get("forced_syncs") == 0 and not metrics.counters()["syncs"]
    torch.testing.assert_close(lx.cpu(), x)
    torch.testing.assert_close(y.cpu(), x / torch.tensor([3.0, 1, 1, 1, 1, 1]))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_foreach_optimizers_update_in_the_step_graph_and_match_eager(name):
    def make(params):
        if name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    ref = _mlp()
    lz = copy.deepcopy(ref).to(dev)
    opt_r, opt_l = make(ref.parameters()), make(lz.parameters())
    kiln.mark_step()
    metrics.reset()
    torch.manual_seed(2)
    # AdamW's update is lr * m / (sqrt(v) + eps): for an element whose gradient is rounding
    # noise (|g| far below the tensor's largest), a last-bit difference in g moves the parameter
    # by up to lr.  So the gradients are compared at every step, and the parameters everywhere
    # but at such elements (as tests/conformance/_training.py does).
    noisy = [torch.zeros_like(p, dtype=torch.bool) for p in ref.parameters()]
    for _ in range(3):
        x, y = torch.randn(9, 16), torch.randint(0, 5, (9,))
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        torch.nn.functional.cross_entropy(lz(x.to(dev)), y.to(dev)).backward()
        kiln.mark_step()
        for i, (pr, pl) in enumerate(zip(ref.parameters(), lz.parameters())):
            torch.testing.assert_close(pl.grad.cpu(), pr.grad)
            noisy[i] |= pr.grad.abs() <= 1e-4 * pr.grad.abs().max()
        opt_r.step()
        opt_r.zero_grad()
        opt_l.step()
        opt_l.zero_grad()
        kiln.mark_step()
    assert metrics.counters().get("forced_syncs", 0) == 0  # no op ran on values
    assert metrics.counters()["native_inplace_writes"] > 0
    for (pname, pr), pl, low in zip(ref.named_parameters(), lz.parameters(), noisy):
        keep = ~low if name == "adamw" else torch.ones_like(low)
        assert keep.float().mean() > 0.9, pname  # the comparison covers most of the tensor
        torch.testing.assert_close(pl.detach().cpu()[keep], pr.detach()[keep], msg=pname)
    for sr, sl in zip(opt_r.state.values(), opt_l.state.values()):
        for k, v in sr.items():
            torch.testing.assert_close(sl[k].cpu(), v, msg=k)


def test_out_ops_write_the_storage_after_earlier_ops_read_it():
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    x = torch.ones(3, 4)
    lx = lazy(x)
    kiln.mark_step()
    ly = lx * 2  # recorded before the write: reads the old x
    torch.mm(lazy(a), lazy(b), out=lx)
    torch.testing.assert_close(ly.cpu(), x * 2)
    torch.testing.assert_close(lx.cpu(), a @ b)
    big = torch.zeros(5, 4)
    lbig = lazy(big)
    torch.mm(lazy(a), lazy(b), out=lbig[1:4])  # into a view: lands in its base
    big[1:4] = a @ b
    torch.testing.assert_close(lbig.cpu(), big)
    small = torch.zeros(2, 2, device=dev)
    with pytest.warns(UserWarning, match="resized"):  # resized, with eager's warning
        torch.mm(lazy(a), lazy(b), out=small)  # (test_native_resize.py: more cases)
    assert small.shape == (3, 4)
    torch.testing.assert_close(small.cpu(), a @ b)
    kiln.mark_step()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors_on_the_device_are_a_clear_error():
    x = torch.eye(3).to_sparse_csr().to(dev)
    a = lazy(torch.randn(3, 3))
    with pytest.raises(RuntimeError, match="sparse_csr tensors are not supported on the kiln"):
        torch.sparse.sampled_addmm(x, a, a)
    kiln.mark_step()
    torch.testing.assert_close((a + 1).cpu(), native.cpu(a) + 1)


def test_autocast_on_the_kiln_device_reaches_native_tensors():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    la, lb = lazy(a), lazy(b)
    with torch.autocast("kiln", dtype=torch.bfloat16):
        got = la @ lb
        loss = torch.nn.functional.mse_loss(got, lazy(torch.zeros(5, 3)))  # an fp32 op
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = a @ b
        want_loss = torch.nn.functional.mse_loss(want, torch.zeros(5, 3))
    assert got.dtype == want.dtype == torch.bfloat16
    assert loss.dtype == want_loss.dtype
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(loss.cpu(), want_loss)
    assert (la @ lb).dtype == torch.float32  # outside the region: no autocast


def test_memory_statistics_count_native_buffers():
    gc.collect()  # earlier tests' tensors in reference cycles go now, not between the checks
    kiln.mark_step()
    before = torch.kiln.memory_allocated()
    keep = torch.ones(1000).to(dev)
    assert torch.kiln.memory_allocated() >= before + 4000
    out = keep * 2
    kiln.mark_step()  # the step's result is a buffer too
    assert torch.kiln.memory_allocated() >= before + 8000
    assert torch.kiln.max_memory_allocated() >= torch.kiln.memory_allocated()
    del keep, out
    assert torch.kiln.memory_allocated() <= before


def test_conj_and_neg_bits_are_computed_values():
    z = torch.randn(4, dtype=torch.complex64)
    lz = lazy(z)
    got = torch.view_as_real(lz.conj().resolve_conj())
    torch.testing.assert_close(got.cpu(), torch.view_as_real(z.conj().resolve_conj()))
    torch.testing.assert_close((-lz.imag).cpu(), -z.imag)
    torch.testing.assert_close((lz.conj() * 2).cpu(), z.conj() * 2)


def test_the_eager_debug_mode_uses_the_python_recorder():
    kiln.config.update(eager=True)
    try:
        x = torch.ones(3, device=dev)
        assert type(x) is LazyTensor  # the Python recorder implements config.eager
    finally:
        kiln.config.update(eager=False)
    assert native.is_native(torch.ones(3, device=dev))


def test_writes_through_a_view_made_on_the_values_reach_its_base():
    """``as_strided`` runs on the values: its result shares the base's buffer, so a write to it
    (``copy_``, what as_strided's backward does) lands in that buffer, not in a new value."""
    x = torch.randn(5, 5)
    g = torch.randn(2, 2)
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.as_strided(xr, (2, 2), (1, 2), 1), xr, g)
    xl = lazy(x).requires_grad_()
    (got,) = torch.autograd.grad(torch.as_strided(xl, (2, 2), (1, 2), 1), xl, lazy(g))
    torch.testing.assert_close(got.cpu(), want)
    base = torch.zeros(9, device=dev)
    view = torch.as_strided(base, (2, 2), (1, 3), 1)
    view.copy_(torch.ones(2, 2))  # a CPU value: not an upload into a fresh buffer either
    view.mul_(lazy(torch.full((2, 2), 3.0)))
    eager = torch.zeros(9)
    ev = torch.as_strided(eager, (2, 2), (1, 3), 1)
    ev.copy_(torch.ones(2, 2))
    ev.mul_(3.0)
    torch.testing.assert_close(base.cpu(), eager)


def test_a_view_made_on_the_values_sees_later_writes_to_its_base():
    x = torch.randn(9)
    lx = lazy(x)
    lv = torch.as_strided(lx, (2, 2), (1, 3), 1)  # runs on the values: shares lx's buffer
    v = torch.as_strided(x, (2, 2), (1, 3), 1)
    lx.add_(1.0)  # (not a new value for lx's storage: the view must see it)
    x.add_(1.0)
    lx.copy_(torch.arange(9.0))
    x.copy_(torch.arange(9.0))
    torch.testing.assert_close(lv.cpu(), v)
    torch.testing.assert_close(lx.cpu(), x)


# -- stage 4: errors inside backward --------------------------------------------------------------

_BACKWARD_ERROR_AFTER_EAGER = """
import json, threading
import torch
a = torch.randn(3, requires_grad=True)
a.sin().sum().backward()  # the engine starts before kiln is imported: no kiln device queue
import kiln
from kiln.frontends.lazy import backward_thread, native
from kiln.frontends.lazy import tensor as lazy_tensor
kiln.config.update(lazy_recorder="native")
dev = kiln.device()
seen = []

class Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        seen.append(threading.get_ident() == threading.main_thread().ident)
        return (g.view(-1, 1) @ torch.ones(2, 5, device=dev)).sum(1)

x = torch.randn(3).to(dev).requires_grad_()
try:
    Bad.apply(x).sum().backward()
    message = None
except RuntimeError as e:
    message = str(e)
w = torch.randn(4, 3)
lw = w.to(dev).requires_grad_()
(lw.cos() * 3.0).sum().backward()
kiln.mark_step()
want = -3.0 * w.sin()
print(json.dumps({
    "installed": backward_thread.installed(), "native": native.is_native(lw), "seen": seen,
    "message": message, "kept": type(lazy_tensor.last_backward_error).__name__,
    "count": kiln.metrics.get("backward_errors"),
    "grad_ok": bool(torch.allclose(lw.grad.cpu(), want, atol=1e-6)),
}))
"""


def test_an_error_in_backward_after_an_eager_backward_is_raised_on_the_calling_thread():
    # a process whose autograd engine started before `import kiln` runs kiln's backward passes
    # on the calling thread (backward_thread.install): a recording error there is reported the
    # same way (named, kept, counted) and the device keeps working
    out = run_json(_BACKWARD_ERROR_AFTER_EAGER, KILN_LAZY_RECORDER="native")
    assert out["installed"] and out["native"] and out["seen"] == [True]
    assert out["message"] is not None
    assert "backward pass failed on the kiln device in aten.mm.default" in out["message"]
    assert "same reduction dim" in out["message"]
    assert out["kept"] == "RuntimeError" and out["count"] == 1
    assert out["grad_ok"]
