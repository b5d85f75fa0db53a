"""The lazy device's fast recording path (recipes by call signature) and the recognition of a
repeated step (Trace.expect): same graphs and values as the general path and as eager."""

import copy

import pytest
import torch
from optim_cases import mse_step

import kiln
from kiln import metrics
from kiln.frontends.lazy import native, recipes
from kiln.frontends.lazy import trace as T

dev = kiln.device()


def _step(x: torch.Tensor, w: torch.Tensor, lr: float) -> torch.Tensor:
    h = torch.relu(x @ w + 0.5) * lr
    m, i = h.max(dim=1)  # a tuple-output op
    return (h - m[:, None]).exp().sum() + i.sum()


def test_replayed_steps_match_eager_and_are_recognised_without_pruning(monkeypatch):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    lx, lw = x.to(dev), w.to(dev)
    kiln.mark_step()
    pruned = []
    native = kiln.config.lazy_recorder == "native"
    if native:  # the native recorder recognises a graph in C++ and converts (prunes) new ones only
        from kiln.frontends.lazy import native as N

        real_convert = N.convert
        monkeypatch.setattr(N, "convert", lambda *a: pruned.append(1) or real_convert(*a))
    else:
        real = T._prune_uncached
        monkeypatch.setattr(
            T, "_prune_uncached", lambda tr, outs: pruned.append(1) or real(tr, outs)
        )
    got, counts = [], []
    for k in range(4):  # a new lr every step: a lifted scalar, not a new graph or recipe
        out = _step(lx, lw, 0.1 * (k + 1))
        kiln.mark_step()
        counts.append(len(pruned))
        got.append(out.cpu())
        torch.testing.assert_close(got[-1], _step(x, w, 0.1 * (k + 1)))
    # the step pruned once; from the third on it matched the previous graph node by node
    assert len(pruned) <= 2
    assert counts[3] == counts[1]
    if not native:
        assert T.current().expect is not None


def test_signatures_tell_int_bool_and_float_arguments_apart():
    xi = torch.arange(6).reshape(2, 3)
    li = xi.to(dev)
    # pow keeps its exponent (not lifted): 2 and 2.0 give different dtypes
    for e in (2, 2.0, 3, True):
        got = torch.pow(li, e).cpu()
        want = torch.pow(xi, e)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    # sum over a dim given as int, list and tuple, keepdim as bool
    for dim, keep in ((1, True), ([1], False), ((0, 1), True), (0, False)):
        torch.testing.assert_close(li.sum(dim, keep).cpu(), xi.sum(dim, keep))


@pytest.mark.parametrize("order", [1, -1], ids=["int-first", "float-first"])
def test_factories_of_equal_int_float_bool_and_complex_values_keep_their_dtypes(order):
    """``6 == 6.0 == 6+0j`` and ``1 == True`` as dictionary keys; the shape-inference cache once
    answered ``arange(7)`` with the float32 meta of an earlier ``arange(7.0)`` (and ``full`` with
    the dtype of whichever fill came first), silently making int indices floats."""
    calls = [
        (torch.arange, (7,), {}),
        (torch.arange, (7.0,), {}),
        (torch.arange, (1, 7), {}),
        (torch.arange, (1.0, 7.0), {}),
        (torch.full, ((3,), 5), {}),
        (torch.full, ((3,), 5.0), {}),
        (torch.full, ((3,), 5 + 0j), {}),
        (torch.full, ((2,), 1), {}),
        (torch.full, ((2,), True), {}),
        (torch.full, ((2,), 1.0), {}),
        (torch.scalar_tensor, (1,), {}),
        (torch.scalar_tensor, (True,), {}),
    ][::order]
    for fn, args, kw in calls * 2:
        got, want = fn(*args, **kw, device=dev), fn(*args, **kw)
        assert got.dtype == want.dtype, (fn.__name__, args)
        assert torch.equal(got.cpu(), want), (fn.__name__, args)
    xb = torch.tensor([True, False])  # bool + True is bool, bool + 1 is int64
    for s in (True, 1, True, 1.0)[::order]:
        got, want = (xb.to(dev) + s).cpu(), xb + s
        assert got.dtype == want.dtype and torch.equal(got, want), s


def test_a_recipe_is_keyed_on_geometry_not_values():
    a, b = torch.randn(3, 4), torch.randn(4, 3).t()  # same shape, other strides
    la, lb = a.to(dev), b.to(dev)
    for x, lx in ((a, la), (b, lb), (a, la)):
        torch.testing.assert_close((lx * 2.5 + 1).cpu(), x * 2.5 + 1)
        assert (lx * 2.5 + 1).stride() == (x * 2.5 + 1).stride()
    if kiln.config.lazy_recorder == "native":
        _native_recipes_are_keyed_on_geometry(la, lb)
        return
    leaves: list = []
    key = recipes.signature(object(), (la, 2.5), {}, True, leaves)
    assert key is not None and leaves == [la, 2.5]
    assert recipes.signature(object(), (la, torch.ones(2)), {}, True, []) is None


def _native_recipes_are_keyed_on_geometry(la: torch.Tensor, lb: torch.Tensor) -> None:
    """The same property on the native recorder, whose recipes live in C++: a trace's structural
    hash is made of its recipe ids, so equal hashes mean the same recipes were used."""
    from kiln.frontends.lazy import native

    la2 = torch.randn(3, 4).to(dev)  # la's geometry, other values
    kiln.mark_step()
    calls = native.python_ops()
    hashes = []
    for lx, s in ((la, 2.5), (la2, 3.5), (lb, 2.5)):
        y = lx * s + 1
        hashes.append(native.trace_hash())
        kiln.mark_step()
        del y
    assert hashes[0] == hashes[1] != hashes[2]  # other values: same recipes; other strides: not
    assert native.python_ops() == calls  # every call served by a C++ recipe
    with pytest.raises(RuntimeError, match="same device"):  # a CPU operand is no recipe key:
        la * torch.ones(4)  # the call goes to the Python fallback, which names both devices
    assert native.python_ops()["aten::mul.Tensor"] == calls.get("aten::mul.Tensor", 0) + 1


_DEFAULT_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(_DEFAULT_OPTIMIZERS))
def test_foreach_optimizer_updates_are_fused_and_in_place(name):
    """Default (foreach) optimizers: parameters and optimizer state keep their buffers across
    steps, the update is generated kernels (no _foreach_* op reaches ATen), values as in eager."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    lazy = copy.deepcopy(model).to(dev)
    make = _DEFAULT_OPTIMIZERS[name]
    opt, lazy_opt = make(model.parameters()), make(lazy.parameters())
    eager, lazy_step = mse_step(model, opt), mse_step(lazy, lazy_opt)

    def buffers() -> list[int]:
        ts = list(lazy.parameters())
        for st in lazy_opt.state.values():
            ts += [v for v in st.values() if isinstance(v, torch.Tensor) and v.device == dev]
        return [t.data_ptr() for t in ts]  # (either recorder: public API, no sync after a step)

    before = dict(metrics.counters()["fallbacks"])
    ptrs = None
    for _ in range(4):
        x, y = torch.randn(5, 6), torch.randn(5, 3)
        eager(x, y)
        lazy_step(x.to(dev), y.to(dev))
        kiln.mark_step()
        now = buffers()
        if ptrs is not None:
            assert now == ptrs
        ptrs = now
    assert len(ptrs) > len(list(lazy.parameters()))  # the optimizer state is checked too
    after = metrics.counters()["fallbacks"]
    assert not [op for op in after if op.startswith("_foreach") and after[op] != before.get(op)]
    for a, b in zip(model.parameters(), lazy.parameters()):
        torch.testing.assert_close(b.cpu(), a.detach())
    for sa, sb in zip(opt.state.values(), lazy_opt.state.values()):
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                torch.testing.assert_close(sb[k].cpu(), sa[k])


def test_a_new_default_dtype_is_not_served_a_cached_dtype():
    old = torch.get_default_dtype()
    try:
        for dt in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(dt)
            assert torch.zeros(3, device=dev).dtype == dt
            assert torch.full((2,), 1.5, device=dev).cpu().dtype == dt
            half = torch.arange(3, device=dev) * 0.5  # int tensor * float: the default dtype
            torch.testing.assert_close(half.cpu(), torch.arange(3) * 0.5)
    finally:
        torch.set_default_dtype(old)


def test_detach_and_alias_record_no_node_and_writes_still_reach_every_alias():
    """A Parameter made from a kiln tensor is ``data.detach()`` (torch.nn's path for tensor
    subclasses): reading it, or any detached or aliased tensor, records no node -- a ``detach``
    between AdamW's weight decay and its update split the update into two kernels -- and a write
    through such a view still reaches the parameter, as in eager."""
    torch.manual_seed(5)
    base = torch.randn(4, 3)
    p_cpu = torch.nn.Parameter(base.clone())
    p = torch.nn.Parameter(base.to(dev))
    kiln.mark_step()
    results = []
    for q in (p_cpu, p):
        d = q.detach()
        assert d is not q and not d.requires_grad
        d.mul_(2.0)  # through the detach view: q changes too
        a = torch.ops.aten.alias.default(d)
        a.add_(1.0)  # through an alias of it
        with torch.no_grad():
            q.sub_(0.5)  # the parameter itself, read back through both views
        results.append([(d * 3).cpu(), a.cpu(), q.detach().cpu()])
        kiln.mark_step()
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(p.detach().cpu(), p_cpu.detach())
    # a step that reads the parameter through its detach chain: no identity view in its graph
    (p * 2).sum().cpu()
    last = native.last_graph() if native.is_native(p) else T._last_entry.graph  # either recorder
    ops = [n.op.split(".")[0] for n in last.nodes]
    assert "mul" in ops
    assert not {"detach", "alias", "lift_fresh"} & set(ops)


@pytest.mark.parametrize("recorder", ["native", "python"])
def test_ops_with_a_torch_decomposition_are_decomposed_not_run_through_aten(recorder):
    """``select_backward``, ``slice_backward`` (indexing's gradients), ``rsub`` and
    ``native_dropout_backward`` have no Kiln rule but a decomposition in torch's core table: the
    step records its parts (no ATen fallback), and the ``type_as`` inside one is recorded on the
    device, not run through the CPU (no sync)."""
    kiln.config.update(lazy_recorder=recorder)
    try:
        x = torch.randn(5, 6, requires_grad=True)
        mask = torch.rand(5, 6) > 0.3

        def fn(t, m):
            y = (t[:, 2] * 3).sum() + (t[1:4] ** 2).sum() + torch.rsub(t, 2.0).pow(2).sum()
            d = torch.ops.aten.native_dropout_backward(t * 1, m, 2.0)
            return y + d.sum()

        fn(x, mask).backward()
        lx = x.detach().to(dev).requires_grad_()
        kiln.mark_step()
        metrics.reset()
        fn(lx, mask.to(dev)).backward()
        kiln.mark_step()
        assert metrics.counters()["fallbacks"] == {}
        assert metrics.counters()["syncs"] == {}
        torch.testing.assert_close(lx.grad.cpu(), x.grad)
    finally:
        kiln.config.update(lazy_recorder="native")


def _trace_len() -> int:
    """Nodes recorded so far in the current step (either recorder)."""
    if kiln.config.lazy_recorder == "native":
        return native.trace_len()
    return len(T.current().b.nodes)


_FILLS = {
    "zeros": lambda t: torch.zeros_like(t),
    "ones_f64": lambda t: torch.ones_like(t, dtype=torch.float64),
    "full": lambda t: torch.full_like(t, 2.5),
    "transposed": lambda t: torch.zeros_like(t.t()),  # preserve_format: the view's strides
    "strided": lambda t: torch.full_like(t[:, ::2], -1.0),  # not dense: contiguous
    "channels_last": lambda t: torch.zeros_like(
        t.view(1, 2, 3, 4), memory_format=torch.channels_last
    ),
    "empty_rows": lambda t: torch.zeros_like(t[:0]),
}


@pytest.mark.parametrize("case", list(_FILLS))
def test_fills_of_a_tensor_holding_data_are_made_as_data(case):
    """``zeros_like(param)`` (an optimizer creating its state), ``ones_like``, ``full_like`` of a
    tensor whose value is data: made at once as data of their own (nothing recorded, no step to
    read them), with eager's values, dtype and strides; writes into them stay in their buffer."""
    torch.manual_seed(6)
    w_cpu = torch.randn(6, 4)
    w = w_cpu.to(dev)
    kiln.mark_step()
    metrics.reset()
    before = _trace_len()
    want, got = _FILLS[case](w_cpu), _FILLS[case](w)
    assert _trace_len() == before
    assert got.device == dev and got.dtype == want.dtype
    assert got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got.cpu(), want)
    assert metrics.counters()["syncs"] == {}
    # updated in place over steps: its own buffer, which keeps its address
    ptr = got.data_ptr()
    for _ in range(3):
        got.add_(2.0)
        want.add_(2.0)
        kiln.mark_step()
    assert got.data_ptr() == ptr
    torch.testing.assert_close(got.cpu(), want)


def test_fills_of_a_pending_value_are_recorded_and_a_cpu_fill_is_a_cpu_tensor():
    w_cpu = torch.randn(5, 3)
    w = w_cpu.to(dev)
    kiln.mark_step()
    y = w * 3  # pending: its fill is a node of the step, fused into its readers
    before = _trace_len()
    z = torch.full_like(y, 0.5) + y
    assert _trace_len() > before + 1
    torch.testing.assert_close(z.cpu(), w_cpu * 3 + 0.5)
    c = torch.zeros_like(w, device="cpu")
    assert c.device.type == "cpu"
    torch.testing.assert_close(c, torch.zeros(5, 3))


@pytest.mark.parametrize(
    ("make", "on_cpu"),
    [
        (lambda t: t.new_zeros((2, 3), device="cpu"), True),
        (lambda t: torch.empty_like(t, device="cpu").fill_(1.0), True),
        (lambda t: t.new_zeros((2, 3)), False),
        (lambda t: torch.empty_like(t).fill_(1.0), False),
    ],
    ids=["new_zeros_cpu", "empty_like_cpu", "new_zeros", "empty_like"],
)
def test_factories_of_a_kiln_tensor_make_the_device_asked_for(make, on_cpu):
    """``new_zeros`` / ``empty_like`` of a kiln tensor: a CPU tensor where ``device="cpu"`` is
    asked for (the native recorder records these ops in C++ and must leave that call to Python),
    a kiln tensor otherwise; eager's values either way."""
    w = torch.randn(4, 3).to(dev)
    got, want = make(w), make(torch.randn(4, 3))
    assert got.device == (torch.device("cpu") if on_cpu else dev)
    torch.testing.assert_close(got.cpu(), want)
