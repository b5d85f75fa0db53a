"""Activation checkpointing, autocast and the ``torch.kiln`` device module on the kiln device."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.utils.checkpoint as cp
from _subprocess import start_python
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

import kiln

DEV = kiln.device()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)
    )


def _grads(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().cpu() for p in m.parameters()]


@pytest.mark.one_recorder  # CPU tensors only
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_on_cpu_tensors_with_kiln_imported(use_reentrant):
    m = _mlp()
    x = torch.randn(4, 16, requires_grad=True)
    out = cp.checkpoint(m, x, use_reentrant=use_reentrant)
    out.pow(2).sum().backward()
    ref = _mlp()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).pow(2).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for a, b in zip(_grads(m), _grads(ref)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_on_the_lazy_device_matches_eager(use_reentrant):
    ref = _mlp()
    x = torch.randn(8, 16)
    xr = x.clone().requires_grad_()
    cp.checkpoint(ref, xr, use_reentrant=use_reentrant).pow(2).sum().backward()

    m = _mlp().to(DEV)
    xk = x.to(DEV).requires_grad_()
    loss = cp.checkpoint(m, xk, use_reentrant=use_reentrant).pow(2).sum()
    loss.backward()
    kiln.mark_step()
    # fp32 reduction order differs from ATen's in Kiln's fused kernels: ~1e-6 relative
    torch.testing.assert_close(xk.grad.cpu(), xr.grad, rtol=1e-5, atol=1e-5)
    for a, b in zip(_grads(m), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_repeats_the_dropout_mask_on_the_lazy_device(use_reentrant):
    # The recompute must see the forward's mask (eager restores the RNG state for it): the
    # gradient of 3 * dropout(x) is nonzero exactly where the forward output is.
    torch.manual_seed(1)
    x = torch.randn(64, 32).to(DEV).requires_grad_()

    def f(t):
        return torch.nn.functional.dropout(t, 0.5, training=True) * 3.0

    out = cp.checkpoint(f, x, use_reentrant=use_reentrant)
    out.sum().backward()
    kiln.mark_step()
    o, g = out.detach().cpu(), x.grad.cpu()
    assert 0.3 < (o != 0).float().mean().item() < 0.7
    assert torch.equal(o != 0, g != 0)
    torch.testing.assert_close(g[g != 0], torch.full_like(g[g != 0], 6.0))


def test_rng_state_restore_within_a_step_repeats_draws_as_eager():
    s = torch.kiln.get_rng_state()
    a = torch.rand(5, device=DEV)
    torch.kiln.set_rng_state(s)
    b = torch.rand(5, device=DEV)
    c = torch.rand(5, device=DEV)  # past the rewound region: a fresh draw
    kiln.mark_step()
    assert torch.equal(a.cpu(), b.cpu())
    assert not torch.equal(b.cpu(), c.cpu())


@pytest.mark.one_recorder  # compile mode only
def test_checkpoint_in_compile_mode():
    ref = _mlp()
    m = _mlp()

    def loss_fn(mod, t):
        return cp.checkpoint(mod, t, use_reentrant=False).pow(2).sum()

    x = torch.randn(4, 16)
    loss_fn(ref, x).backward()
    compiled = torch.compile(loss_fn, backend="kiln")
    compiled(m, x).backward()
    for a, b in zip(_grads(m), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# autocast: PyTorch's own CPU autocast op lists, kiln autocast vs eager CPU autocast


def _autocast_cases() -> list:
    lists = AutocastCPUTestLists("cpu")
    cases = []
    for group in ("torch_16", "torch_fp32", "nn_16", "nn_fp32"):
        module = torch._C._nn if group.startswith("nn") else torch
        for entry in getattr(lists, group):
            op, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 else {}
            cases.append(pytest.param(module, op, args, kwargs, id=f"{group}-{op}"))
    for op, args_bf16, _, _ in lists.torch_expect_builtin_promote:
        cases.append(pytest.param(torch, op, args_bf16, {}, id=f"builtin_promote-{op}"))
    for op, args_bf16, _ in lists.torch_need_autocast_promote:
        cases.append(pytest.param(torch, op, args_bf16, {}, id=f"promote-{op}"))
    return cases


def _to_kiln(a):
    if isinstance(a, torch.Tensor):
        return a.to(DEV)
    if isinstance(a, (list, tuple)):
        return type(a)(_to_kiln(x) for x in a)
    return a


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return []


@pytest.mark.parametrize("module,op,args,kwargs", _autocast_cases())
def test_kiln_autocast_matches_cpu_autocast(module, op, args, kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = getattr(module, op)(*args, **kwargs)
    kargs = _to_kiln(args)
    with torch.autocast("kiln", dtype=torch.bfloat16):
        assert (
            torch.kiln.is_autocast_enabled() and torch.kiln.get_autocast_dtype() == torch.bfloat16
        )
        got = getattr(module, op)(*kargs, **kwargs)
    assert not torch.is_autocast_enabled("kiln")
    want, got = _flat(want), _flat(got)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert g.device.type == "kiln" and g.dtype == w.dtype, (op, g.dtype, w.dtype)
        tol = {"rtol": 1.6e-2, "atol": 1e-2} if w.dtype == torch.bfloat16 else {}
        torch.testing.assert_close(g.cpu(), w, **tol)


def test_kiln_autocast_training_step_matches_cpu_autocast():
    x = torch.randn(8, 16)
    ref = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(x)
    out_ref.float().pow(2).mean().backward()
    m = _mlp().to(DEV)
    with torch.autocast("kiln", dtype=torch.bfloat16):
        out = m(x.to(DEV))
    out.float().pow(2).mean().backward()
    kiln.mark_step()
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), out_ref, rtol=1.6e-2, atol=1e-2)
    for a, b in zip(_grads(m), _grads(ref)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-3)


def test_kiln_autocast_with_an_unsupported_dtype_is_disabled_with_a_warning():
    with pytest.warns(UserWarning, match="kiln Autocast only supports"):
        with torch.autocast("kiln", dtype=torch.float64):
            assert not torch.is_autocast_enabled("kiln")


# ---------------------------------------------------------------------------------------------
# the device module


def test_device_module_interface():
    mod = torch.get_device_module("kiln")
    assert mod is torch.kiln and torch.accelerator.current_accelerator().type == "kiln"
    assert mod.device_count() == 1 and mod.current_device() == 0 and mod.is_available()
    mod.set_device(0)
    mod.set_device("kiln:0")
    with pytest.raises(ValueError, match=r"kiln:3 does not exist.*valid: 'kiln', 'kiln:0'"):
        mod.set_device(3)
    with mod.device(0):
        pass
    # a tensor made for a device that does not exist: the same error, not a tensor on kiln:0
    made = (
        lambda: torch.zeros(2, device="kiln:1"),
        lambda: torch.randn(2, device="kiln:2"),
        lambda: torch.ones(2).to("kiln:3"),
        lambda: torch.zeros(2, device=DEV).new_zeros(3, device="kiln:1"),
    )
    for make in made:
        with pytest.raises(ValueError, match=r"kiln:\d does not exist.*valid: 'kiln', 'kiln:0'"):
            make()
    assert torch.zeros(2, device="kiln:0").device == torch.ones(2).to("kiln").device == DEV
    assert torch.bfloat16 in mod.get_amp_supported_dtype()
    before = mod.memory_allocated()
    keep = torch.ones(1000, dtype=torch.float32).to(DEV)
    assert mod.memory_allocated() >= before + 4000
    assert mod.max_memory_allocated() >= mod.memory_allocated()
    mod.empty_cache()
    del keep
    s, e = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    s.record()
    y = torch.randn(64, 64, device=DEV) @ torch.randn(64, 64, device=DEV)
    e.record()
    assert s.elapsed_time(e) >= 0.0 and y.device.type == "kiln"
    stream = mod.Stream()
    with mod.stream(stream):
        stream.wait_stream(mod.current_stream())
    stream.synchronize()
    mod.synchronize()
    torch.kiln.manual_seed(7)
    a = torch.randn(3, device=DEV).cpu()
    torch.kiln.manual_seed(7)
    assert torch.equal(a, torch.randn(3, device=DEV).cpu())


def test_gc_freeze_is_off_by_default():
    import gc

    assert not kiln.config.gc_freeze
    before = gc.get_freeze_count()
    freezes = kiln.metrics.get("heap_freezes")
    (torch.randn(5, 9).to(DEV) * 1.5 - 0.25).tanh().sum().item()  # a new graph
    assert kiln.metrics.get("heap_freezes") == freezes
    # (objects frozen by an earlier test that die now -- an entry a bounded cache evicts --
    # lower the count; a freeze would raise it)
    assert gc.get_freeze_count() <= before


# ---------------------------------------------------------------------------------------------
# import order (fresh processes)

_TRAIN_AFTER_EAGER = textwrap.dedent(
    """
    import torch
    x = torch.randn(4, 3, requires_grad=True)
    (x * 2).sum().backward()                      # an eager backward before kiln exists
    import kiln
    dev = kiln.device()
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2); ref.load_state_dict(m.state_dict())
    m.to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        b = torch.randn(5, 3)
        loss = m(b.to(dev)).pow(2).mean(); loss.backward(); kiln.optimizer_step(opt); opt.zero_grad()
        loss_ref = ref(b).pow(2).mean(); loss_ref.backward(); opt_ref.step(); opt_ref.zero_grad()
        assert abs(loss.item() - loss_ref.item()) < 1e-6, (loss.item(), loss_ref.item())
    print("TRAINED")
    """
)


def test_import_order_does_not_matter():
    # three fresh processes, run side by side: kiln imported after an eager backward pass (the
    # engine then has no kiln queue: kiln's backward passes run on the calling thread) and before
    # it; both train with eager's numbers.  PyTorch's device-backend autoload switch changes
    # nothing (kiln registers nothing at import torch)
    procs = {
        "late": start_python(_TRAIN_AFTER_EAGER + _THREADING),
        "late, autoload off": start_python(_TRAIN_AFTER_EAGER, TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
        "early": start_python("import kiln\n" + _TRAIN_AFTER_EAGER + _THREADING),
    }
    res = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
    for k, ((out, err), rc) in res.items():
        assert rc == 0 and "TRAINED" in out, (k, err[-3000:])
    assert "calling thread True" in res["late"][0][0]
    assert "calling thread False" in res["early"][0][0]


_THREADING = textwrap.dedent(
    """
    from kiln.frontends.lazy import backward_thread
    print("calling thread", backward_thread.installed())
    """
)
