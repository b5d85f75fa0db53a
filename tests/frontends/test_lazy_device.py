"""Lazy device semantics against eager PyTorch: views, in-place writes, factories, randomness,
scalars, syncs, errors."""

import copy

import pytest
import torch
from optim_cases import OPTIMIZERS, mse_step

import kiln
from kiln import metrics

dev = kiln.device()


def lazy(t: torch.Tensor) -> torch.Tensor:
    return t.to(dev)


def test_device_is_torch_device():
    assert isinstance(dev, torch.device)
    assert dev.type == "kiln" and dev.index == 0
    x = torch.ones(2, device=dev)
    assert x.device == dev


def test_elementwise_and_reductions_match_eager():
    x = torch.randn(5, 7)
    y = torch.randn(7)
    got = ((lazy(x) * 2 + lazy(y)).softmax(-1).sum(0)).cpu()
    torch.testing.assert_close(got, (x * 2 + y).softmax(-1).sum(0))


def test_write_through_view_is_seen_by_base():
    x = torch.randn(4, 6)
    y = torch.randn(4)
    lx = lazy(x)
    lx[:, 0] = lazy(y)
    x[:, 0] = y
    torch.testing.assert_close(lx.cpu(), x)


def test_inplace_on_transposed_view_and_chain():
    x = torch.randn(3, 5)
    lx = lazy(x)
    v, lv = x.t()[1:3], lx.t()[1:3]
    v.mul_(3).add_(1)
    lv.mul_(3).add_(1)
    torch.testing.assert_close(lx.cpu(), x)
    torch.testing.assert_close(lv.cpu(), v)


def test_views_alias_after_base_write():
    x = torch.randn(2, 3)
    lx = lazy(x)
    lview = lx.view(6)
    lx.zero_()
    assert lview.cpu().abs().sum().item() == 0


def test_split_unbind_write():
    x = torch.arange(12.0).reshape(3, 4)
    lx = lazy(x)
    a, b = lx.split(2, dim=1)
    b.fill_(-1)
    r0 = lx.unbind(0)[0]
    r0.add_(100)
    x[:, 2:] = -1
    x[0] += 100
    torch.testing.assert_close(lx.cpu(), x)


def test_strides_match_eager():
    x = torch.randn(4, 6)
    lx = lazy(x)
    assert lx.t().stride() == x.t().stride()
    assert lx[:, 1:].storage_offset() == x[:, 1:].storage_offset()


def test_factories_with_device():
    z = torch.zeros(3, 2, device=dev)
    o = torch.ones(3, 2, device=dev)
    a = torch.arange(6, device=dev, dtype=torch.float32).reshape(3, 2)
    torch.testing.assert_close((z + o + a).cpu(), 1 + torch.arange(6.0).reshape(3, 2))


def test_cpu_source_is_copied_at_copy_time():
    src = torch.ones(3)
    lx = torch.zeros(3, device=dev)
    lx.copy_(src)
    src.fill_(7)  # later changes to the CPU tensor are not seen
    torch.testing.assert_close(lx.cpu(), torch.ones(3))


def test_mixing_devices_names_both():
    with pytest.raises(RuntimeError) as e:
        torch.ones(3, device=dev) + torch.ones(3)
    msg = str(e.value)
    assert "found at least two devices, kiln:0 and cpu" in msg
    assert ".to(kiln.device())" in msg


def test_sparse_tensor_on_the_device_is_a_clear_error():
    """A sparse CSR tensor moved to the kiln device is not recorded: an op on it names the
    layout and the fix (it used to say 'found at least two devices, kiln:0 and kiln:0')."""
    x = torch.eye(3).to_sparse_csr().to(dev)
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="sparse_csr tensors are not supported on the kiln"):
        torch.sparse.sampled_addmm(x, a.to(dev), b.to(dev))
    kiln.mark_step()  # nothing pending was left broken
    torch.testing.assert_close((lazy(a) + 1).cpu(), a + 1)


def test_backward_through_a_copy_to_the_cpu():
    """A copy to the CPU is differentiable, with or without a dtype change (where PyTorch's
    engine asserts on device streams instead, kiln raises an error naming the fix: see
    tests/conformance/test_opinfo.py::test_lazy_to_cpu_backward_never_shows_the_engine_assert)."""
    w = torch.randn(3).to(dev).requires_grad_()
    (w * 2).cpu().sum().backward()
    (g,) = torch.autograd.grad(w.double().cpu().sum(), [w])
    (g2,) = torch.autograd.grad(w.to("cpu", torch.float64), [w], torch.full((3,), 4.0).double())
    kiln.mark_step()
    torch.testing.assert_close(w.grad.cpu(), torch.full((3,), 2.0))
    torch.testing.assert_close(g.cpu(), torch.ones(3))
    torch.testing.assert_close(g2.cpu(), torch.full((3,), 4.0))


def test_cpu_zero_dim_tensor_is_allowed():
    x = torch.randn(4)
    s = torch.tensor(2.5)
    torch.testing.assert_close((lazy(x) * s).cpu(), x * s)


def test_print_and_item_force_execution():
    metrics.reset()
    x = lazy(torch.full((2,), 3.0)) * 2
    assert "device='kiln:0'" in repr(x)
    assert (x.sum()).item() == 12.0
    c = metrics.counters()
    assert c["syncs"].get("print") == 1
    assert c["forced_syncs"] >= 2


def test_data_dependent_op_forces_sync_and_is_counted():
    metrics.reset()
    x = lazy(torch.tensor([0.0, 1.0, 0.0, 2.0]))
    idx = torch.nonzero(x * 1)
    torch.testing.assert_close(idx.cpu(), torch.tensor([[1], [3]]))
    c = metrics.counters()
    assert c["fallbacks"]["nonzero"] == 1
    assert c["syncs"]["op:nonzero"] == 1


def _step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 5)
    )


def test_training_loop_matches_eager_and_stops_compiling():
    ref = _mlp()
    lz = copy.deepcopy(ref).to(dev)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt_l = torch.optim.AdamW(lz.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt_l, step_size=1, gamma=0.9)
    sched_r = torch.optim.lr_scheduler.StepLR(opt_r, step_size=1, gamma=0.9)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    xl, yl = x.to(dev), y.to(dev)
    metrics.reset()
    compiled_after = []
    for _ in range(6):
        lr_ = _step(ref, opt_r, x, y)
        ll = _step(lz, opt_l, xl, yl)
        kiln.mark_step()
        sched.step()
        sched_r.step()
        torch.testing.assert_close(ll.item(), lr_.item(), rtol=1e-5, atol=1e-6)
        compiled_after.append(metrics.get("graphs_compiled") + metrics.get("cache_hits_memory"))
    for p, q in zip(ref.parameters(), lz.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), rtol=1e-4, atol=1e-5)
    # step 1 builds the optimizer state, step 2 is the steady graph; from step 3 on: no compile
    n_compiled = metrics.get("graphs_compiled")
    assert n_compiled <= 3
    reasons = metrics.counters()["recompile_reasons"]
    assert len(reasons) <= 1, reasons  # a changing learning rate is not a new graph


def test_dropout_seed_is_an_input_not_a_new_graph():
    torch.manual_seed(1)
    x = torch.ones(2000, device=dev)
    kiln.mark_step()
    metrics.reset()
    sums = []
    for _ in range(4):
        s = torch.nn.functional.dropout(x, 0.5, training=True).sum()
        kiln.mark_step()
        sums.append(s.item())
    assert len(set(sums)) > 1  # a new mask every step
    assert all(abs(v - 2000) < 300 for v in sums)  # ~half kept, scaled by 2
    assert metrics.get("graphs_compiled") + metrics.get("cache_hits_disk") <= 1


def test_dropout_is_reproducible_under_manual_seed():
    x = torch.ones(500, device=dev)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        y = torch.nn.functional.dropout(x, 0.3, training=True)
        kiln.mark_step()
        outs.append(y.cpu())
    torch.testing.assert_close(outs[0], outs[1])


def test_optimizer_step_helper():
    m = torch.nn.Linear(4, 1).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = m.weight.cpu().clone()
    m(torch.ones(2, 4, device=dev)).sum().backward()
    kiln.optimizer_step(opt)
    assert not torch.equal(before, m.weight.cpu())


def test_recompile_storm_warns_and_names_input():
    metrics.reset()
    # one graph per shape (with shape-generic graphs, sizes 2..6 share one graph)
    kiln.config.update(recompile_warn=2, dynamic_shapes=False)
    try:
        # shapes no other test makes (this one runs under both recorders, which share the
        # compiled graphs of a process)
        lo = 2 if kiln.config.lazy_recorder == "native" else 12
        with pytest.warns(metrics.RecompileWarning, match="input 0 changed"):
            for n in range(lo, lo + 5):
                x = torch.ones(n).to(dev)
                kiln.mark_step()
                s = (x * 2).sum()
                kiln.mark_step()
                assert s.item() == 2 * n
    finally:
        kiln.config.update(recompile_warn=4, dynamic_shapes=True)


def test_torch_tensor_with_kiln_device():
    t = torch.tensor([1.0, 2.0], device=dev)
    assert t.device == dev
    torch.testing.assert_close((t * 2).cpu(), torch.tensor([2.0, 4.0]))
    assert torch.tensor([], device=dev).shape == (0,)


def test_cpu_index_tensors_are_allowed_like_eager():
    x = torch.arange(6.0).reshape(2, 3)
    lx = lazy(x)
    torch.testing.assert_close(lx[torch.tensor([1, 0])].cpu(), x[torch.tensor([1, 0])])
    torch.testing.assert_close(
        lx[torch.tensor([True, False])].cpu(), x[torch.tensor([True, False])]
    )
    lx[torch.tensor([0])] = 7.0
    x[torch.tensor([0])] = 7.0
    torch.testing.assert_close(lx.cpu(), x)


def test_eager_out_op_does_not_change_what_earlier_ops_read():
    # mm(out=) has no functional form here: it runs eagerly, writing into x's storage; the
    # recorded y = x * 2 must still see the old x
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    x = torch.ones(3, 3)
    lx = lazy(x)
    kiln.mark_step()
    ly = lx * 2
    torch.mm(lazy(a), lazy(b), out=lx)
    torch.testing.assert_close(ly.cpu(), x * 2)
    torch.testing.assert_close(lx.cpu(), a @ b)


def test_device_index_other_than_zero_is_rejected():
    with pytest.raises(ValueError, match=r"Kiln has one lazy device \(index 0\); got index 1"):
        kiln.device(1)


def test_new_graph_freezes_the_heap_for_the_garbage_collector(monkeypatch):
    import gc

    from kiln.frontends.lazy import trace

    monkeypatch.setattr(kiln.config, "gc_freeze", True)  # opt-in: it acts on the whole process
    monkeypatch.setattr(trace, "_settled", trace._SETTLE_MAX - 1)  # one freeze left
    dev = kiln.device()
    before = kiln.metrics.get("heap_freezes")
    # a graph no other test makes (this one runs under both recorders, which share the
    # compiled graphs of a process)
    x = torch.randn(7, 13 if kiln.config.lazy_recorder == "native" else 17).to(dev)
    (x * 3.5 + 1.25).relu().sum().item()
    assert kiln.metrics.get("heap_freezes") == before + 1
    assert gc.get_freeze_count() > 0
    (x * 4.5 + 2.25).relu().sum().item()  # another new graph: the cap is reached, no freeze
    assert kiln.metrics.get("heap_freezes") == before + 1


def test_optimizers_take_the_foreach_path_for_lazy_tensors():
    from torch.optim.optimizer import _default_to_fused_or_foreach

    params = list(torch.nn.Linear(4, 3).to(kiln.device()).parameters())
    assert _default_to_fused_or_foreach(params, differentiable=False) == (False, True)


@pytest.mark.parametrize("make_opt", [m for _, m in OPTIMIZERS], ids=[i for i, _ in OPTIMIZERS])
def test_foreach_optimizers_on_the_lazy_device_match_eager(make_opt):
    import copy

    dev = kiln.device()
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2))
    lazy = copy.deepcopy(model).to(dev)
    opt, lazy_opt = make_opt(model.parameters()), make_opt(lazy.parameters())
    eager, lazy_step = mse_step(model, opt), mse_step(lazy, lazy_opt)
    for _ in range(3):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        eager(x, y)
        lazy_step(x.to(dev), y.to(dev))
        kiln.mark_step()
    for a, b in zip(model.parameters(), lazy.parameters()):
        torch.testing.assert_close(b.cpu(), a.detach())


def test_parameter_updates_reuse_the_parameter_buffers():
    """A per-parameter optimizer loop computes each new value with pointwise ops: the graph writes
    it back into the parameter's own buffer (donation) instead of a new one each step."""
    dev = kiln.device()
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 4)
    lazy = torch.nn.Linear(5, 4).to(dev)
    lazy.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    lazy_opt = torch.optim.AdamW(lazy.parameters(), lr=0.1, foreach=False)
    ptrs = None
    for _ in range(4):
        x = torch.randn(3, 5)
        mse_step(model, opt)(x, torch.zeros(3, 4))
        mse_step(lazy, lazy_opt)(x.to(dev), torch.zeros(3, 4).to(dev))
        kiln.mark_step()
        now = [p.data_ptr() for p in lazy.parameters()]  # (either recorder: public API)
        if ptrs is not None:
            assert now == ptrs
        ptrs = now
    for a, b in zip(model.parameters(), lazy.parameters()):
        torch.testing.assert_close(b.cpu(), a.detach())
