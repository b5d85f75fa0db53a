"""Ops of the workloads' steps recorded in C++ by the native recorder beyond the training ops
(``table.py``'s ``MORE`` and ``inplace_pairs``): tensor lists (``cat``, ``stack``), the splits as
views, GELU-tanh's and ReLU's backward, ``gather``, convolution and max pooling with their
backward ops, dtype casts, the fills of a pending value, and in-place table ops (``sub_``,
``fill_``, ``mul_``, ...) recorded as their functional op and a write-back.  On the kiln device
with the native recorder as its recorder: forward and gradients against eager on odd, size-0 and
non-contiguous inputs with none of these ops in the Python fallback; the converted graph equal to
the Python recorder's; the cases the C++ path leaves to Python (a view written in place, a CPU
operand, a dtype the write cannot take, a fill of a tensor holding data) still eager's values;
a CNN's steady training step against eager."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import (  # noqa: F401 - native_device: the module fixture
    SHAPES,
    check_same_graph_as_the_python_recorder,
    device_recorder,
    native_device,
    on_device_and_eager,
    python_calls_since,
)

import kiln
from kiln.frontends.lazy import native
from kiln.frontends.lazy.native import rng, table

dev = kiln.device()
CPP_OPS = (
    {f"aten::{op}" for op in table.MORE}
    | {f"aten::{inplace}" for inplace, _ in table.inplace_pairs()}
    | {
        "aten::_scaled_dot_product_flash_attention_for_cpu.default",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default",
    }
)

pytestmark = pytest.mark.usefixtures("native_device")


def _index(a: torch.Tensor, n: int) -> torch.Tensor:
    return (a.detach().abs() * 7).long() % max(n, 1)


# (name, function of (x, aux) -> tensor); x is the differentiable input, aux has x's shape
OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cat0": lambda x, a: torch.cat([x, a * x, x[:1]], 0),
    "cat_last": lambda x, a: torch.cat([x * a, x], -1),
    "cat_one": lambda x, a: torch.cat([x * a]),
    "stack": lambda x, a: torch.stack([x, a * x], 1),
    "split": lambda x, a: torch.cat([p * 2.0 for p in (x * a).split(2, -1)][::-1], -1),
    "split_sizes": lambda x, a: (
        torch.cat(
            [
                p * (k + 2.0)
                for k, p in enumerate(x.split([min(1, len(x)), len(x) - min(1, len(x))]))
            ]
        )
        * a
    ),
    "unbind": lambda x, a: torch.stack([r * (i + 1) for i, r in enumerate(x.unbind(-1))], -1) * a,
    "tanh": lambda x, a: torch.tanh(x) * a,
    "relu": lambda x, a: torch.relu(x) * a,
    "gather": lambda x, a: torch.gather(x, -1, _index(a, x.shape[-1])),
    "to_double": lambda x, a: (x.double() * a.double()).float(),
    "ones_like": lambda x, a: (x * a + torch.ones_like(x * a)) * torch.zeros_like(a + 1.0),
    "full_like": lambda x, a: x * torch.full_like(x * a, 2.5),
    "masks": lambda x, a: (
        x * (((x > 0) & (a > 0.5)) | (x < -1)) + x.new_ones(x.shape) + x.new_full((1,), 0.5)
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("name", list(OPS))
def test_op_forward_and_backward_match_eager_in_cpp(name, shape):
    torch.manual_seed(0)
    x = SHAPES[shape]()
    r = on_device_and_eager(OPS[name], x, torch.randn(x.shape).abs() + 0.1)
    torch.testing.assert_close(r["out"], r["want_out"])
    torch.testing.assert_close(r["grad"], r["want_grad"])
    py = {k: v for k, v in r["python"].items() if k in CPP_OPS}
    assert py == {}, f"table ops through the Python fallback: {py}"


def _conv_pool(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = F.conv2d(x, w, b, stride=1, padding=1)
    return F.max_pool2d(torch.relu(h), 2)


@pytest.mark.parametrize(
    "shape", [(2, 3, 8, 8), (1, 3, 5, 7), (0, 3, 6, 6)], ids=["even", "odd", "size0"]
)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_convolution_and_max_pooling_forward_and_backward_in_cpp(shape, layout):
    torch.manual_seed(0)
    x = torch.randn(shape)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(4, 3, 3, 3), torch.randn(4)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    out_r = _conv_pool(*ref)
    (out_r * out_r).sum().backward()
    kiln.mark_step()
    lz = [t.to(dev).requires_grad_() for t in (x, w, b)]
    before = dict(native.python_ops())
    out_l = _conv_pool(*lz)
    (out_l * out_l).sum().backward()
    py = python_calls_since(before, CPP_OPS)
    kiln.mark_step()
    torch.testing.assert_close(out_l.cpu(), out_r.detach())
    for name, r, lt in zip(("x", "w", "b"), ref, lz):
        torch.testing.assert_close(lt.grad.cpu(), r.grad, msg=name, atol=1e-4, rtol=1e-4)
    assert py == {}, f"table ops through the Python fallback: {py}"


def test_no_table_op_lowers_to_a_random_node():
    """The C++ path records no seed: an op Kiln lowers as a random node (seeded from the step's
    seed by the Python fallback, ``rng.py``) must never be in the table."""
    for full in table.OPS:
        name, overload = full.split(".")
        func = getattr(getattr(torch.ops.aten, name), overload)
        assert not rng.is_random_node(func), full


@pytest.mark.parametrize("variant", ["plain", "causal", "bool_mask", "float_mask", "odd"])
def test_sdpa_forward_and_backward_in_cpp(variant):
    torch.manual_seed(0)
    b, h, L, S, e = (1, 3, 5, 7, 6) if variant == "odd" else (2, 2, 8, 8, 4)
    q, k, v = torch.randn(b, h, L, e), torch.randn(b, h, S, e), torch.randn(b, h, S, e)
    mask = None
    if variant == "bool_mask":
        mask = torch.rand(L, S) > 0.3
        mask[:, 0] = True  # no row fully masked
    elif variant == "float_mask":
        mask = torch.randn(b, 1, L, S)

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=variant == "causal")

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_r = fn(*ref, mask)
    (out_r * out_r).sum().backward()
    kiln.mark_step()
    lz = [t.to(dev).requires_grad_() for t in (q, k, v)]
    before = dict(native.python_ops())
    out_l = fn(*lz, None if mask is None else mask.to(dev))
    (out_l * out_l).sum().backward()
    py = python_calls_since(before, CPP_OPS)
    kiln.mark_step()
    torch.testing.assert_close(out_l.cpu(), out_r.detach())
    for name, r, lt in zip("qkv", ref, lz):
        torch.testing.assert_close(lt.grad.cpu(), r.grad, msg=name)
    assert py == {}, f"table ops through the Python fallback: {py}"


# -- in-place table ops: functional op + write-back in C++ ------------------------------------------


def test_inplace_table_ops_on_a_whole_storage_are_recorded_in_cpp():
    x = torch.randn(5, 3)
    lx = x.to(dev)
    kiln.mark_step()
    mod = native.load()
    calls, inplace = mod.python_calls(), mod.inplace_calls()
    before = lx * 2  # recorded before the writes: reads the old value
    lx.sub_(lx * 0.5).mul_(3.0).add_(1.0, alpha=2.0)
    after = lx + 0
    lx.fill_(-1.25)
    last = lx * 1
    assert mod.python_calls() == calls  # no Python fallback call
    assert mod.inplace_calls() == inplace + 4
    kiln.mark_step()
    torch.testing.assert_close(before.cpu(), x * 2)
    torch.testing.assert_close(after.cpu(), (x - x * 0.5) * 3.0 + 2.0)
    torch.testing.assert_close(last.cpu(), torch.full((5, 3), -1.25))
    torch.testing.assert_close(lx.cpu(), torch.full((5, 3), -1.25))


@pytest.mark.parametrize(
    "case",
    ["view", "cpu_operand", "int_takes_float", "comparison", "alias_then_view"],
)
def test_inplace_cases_left_to_python_keep_eager_values(case):
    """What the C++ in-place path does not take goes to the Python fallback unchanged: eager's
    values, or eager's error."""
    x = torch.randn(4, 6)

    def prog(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if case == "view":
            t[1:3].sub_(1.0)  # a write through a view
            return (t * 1,)
        if case == "cpu_operand":
            t.mul_(torch.tensor(3.0))  # a 0-dim CPU tensor
            return (t * 1,)
        if case == "int_takes_float":
            i = (t * 10).long()
            i.add_(2)
            return (i * 1, t * 1)
        if case == "comparison":
            t.gt_(0.25)  # a bool result written back as the tensor's dtype
            return (t * 1,)
        v = t.view(6, 4)
        t.add_(1.0)  # a whole storage with a live view: the view sees the write
        return (v * 1, t * 1)

    want = prog(x.clone())
    lx = x.to(dev)
    kiln.mark_step()
    got = prog(lx)
    kiln.mark_step()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w)
    torch.testing.assert_close(lx.cpu(), prog(x.clone())[-1] if case != "int_takes_float" else x)


def _eager_error(fn, x: torch.Tensor) -> str:
    with pytest.raises(RuntimeError) as e:
        fn(x)
    return str(e.value)


@pytest.mark.parametrize("recorder", ["native", "python"])
def test_an_inplace_write_that_eager_refuses_raises_eagers_error(recorder):
    want = _eager_error(lambda t: t.add_(0.5), torch.arange(6))
    assert want == "result type Float can't be cast to the desired output type Long"
    with device_recorder(recorder):
        i = torch.arange(6).to(dev)
        with pytest.raises(RuntimeError) as got:
            i.add_(0.5)
        assert str(got.value) == want
        kiln.mark_step()
        torch.testing.assert_close(i.cpu(), torch.arange(6))


def test_fills_of_a_tensor_holding_data_are_data_and_of_a_pending_value_nodes():
    x = torch.randn(3, 4).t()  # non-contiguous
    lx = x.to(dev)
    kiln.mark_step()
    mod = native.load()
    calls = mod.python_calls()
    z = torch.zeros_like(lx)  # lx holds data: made as data (the Python fallback)
    assert mod.python_calls() == calls + 1
    assert z.stride() == x.stride()
    y = lx * 2
    o = torch.ones_like(y)  # a pending value: a node, in C++
    f = torch.full_like(y, 7.0, dtype=torch.float64)
    assert mod.python_calls() == calls + 1
    kiln.mark_step()
    torch.testing.assert_close(z.cpu(), torch.zeros_like(x))
    torch.testing.assert_close(o.cpu(), torch.ones(4, 3))
    torch.testing.assert_close(f.cpu(), torch.full((4, 3), 7.0, dtype=torch.float64))


def test_tensor_lists_with_a_cpu_tensor_go_to_python_and_match_eager():
    x, c = torch.randn(2, 3), torch.randn(1, 3)
    with pytest.raises(RuntimeError):
        torch.cat([c, c]) + torch.cat([x.to(dev), c])  # eager's mixed-device error
    kiln.mark_step()
    lx = x.to(dev)
    got = torch.cat([lx, lx * 2], 0)
    kiln.mark_step()
    torch.testing.assert_close(got.cpu(), torch.cat([x, x * 2], 0))


def test_split_pieces_are_views_of_their_tensor():
    x = torch.randn(6, 4)
    lx = x.to(dev)
    kiln.mark_step()
    a, b, _ = lx.split(2)
    r0, *_ = lx.unbind(1)
    a.mul_(2.0)  # a write through a view: every alias sees it
    got = (lx * 1, b * 1, r0 * 1)
    kiln.mark_step()
    want = x.clone()
    want[:2] *= 2.0
    torch.testing.assert_close(got[0].cpu(), want)
    torch.testing.assert_close(got[1].cpu(), want[2:4])
    torch.testing.assert_close(got[2].cpu(), want[:, 0])
    for bad in (
        lambda t: t.split([2, 2]),
        lambda t: t.split([7, -1]),
        lambda t: t.split(0),
        lambda t: t.split(-1),
    ):
        want = _eager_error(bad, x)
        with pytest.raises(RuntimeError) as got:
            bad(lx)
        assert str(got.value) == want


def _program(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The new table ops called directly (no autograd)."""
    aten = torch.ops.aten
    h = x @ w  # (4, 5)
    c = torch.cat([h, h * 2.0], 0)
    s = torch.stack([h, h.relu()], -1)
    p, q = h.split([2, 2], 0)
    u = h.unbind(1)
    tb = aten.tanh_backward(h, torch.tanh(h))
    rb = aten.threshold_backward(h, x @ w, 0.0)
    g = torch.gather(h, 1, (h > 0).long())
    d = h.double() + 1.0
    o = torch.ones_like(h) + torch.zeros_like(c[:1])
    y = h * 1
    y.sub_(p.sum(0)).fill_(0.5)
    # a multi-output op with an absent output (no weight gradient asked for): no getitem node
    ln, mean, rstd = aten.native_layer_norm(h, [5], w[0], w[1], 1e-5)
    gi, none, gb = aten.native_layer_norm_backward(
        ln, h, [5], mean, rstd, w[0], w[1], [True, False, True]
    )
    assert none is None
    m = (((h > 0) & (h < 1)) | (h > 2)) * h.new_full((5,), 0.5) + h.new_ones(5)
    return c, s, p * q, u[0] + u[4], tb, rb, g, d, o, y, gi, gb, m


def test_same_graph_as_the_python_recorder():
    """The converted graph (C++ recipes: tensor-list inputs, split views, write-backs) is node
    for node the Python recorder's graph of the same program: equal structural hash."""
    check_same_graph_as_the_python_recorder(
        _program,
        (torch.randn(4, 3), torch.randn(3, 5)),
        CPP_OPS,
        # (in-place ops: in C++ only with the native recorder as the kiln device's, off here)
        frozenset({"aten::sub_.Tensor", "aten::fill_.Scalar"}),
    )


class _CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = torch.nn.Conv2d(6, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 2 * 2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(torch.relu(self.c1(x)), 2)
        h = F.max_pool2d(torch.relu(self.c2(h)), 2)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_cnn_steady_training_step_matches_eager(opt):
    ref = _CNN()
    lz = copy.deepcopy(ref).to(dev)
    kw = {"lr": 1e-2, "momentum": 0.9} if opt == "SGD" else {"lr": 1e-2}
    opt_r = getattr(torch.optim, opt)(ref.parameters(), **kw)
    opt_l = getattr(torch.optim, opt)(lz.parameters(), **kw)
    kiln.mark_step()
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g)
        tgt = torch.randint(0, 5, (4,), generator=g)
        before = dict(native.python_ops())
        loss_l = F.cross_entropy(lz(x.to(dev)), tgt.to(dev))
        loss_l.backward()
        opt_l.step()
        opt_l.zero_grad()
        py = python_calls_since(before, CPP_OPS)
        kiln.mark_step()
        loss_r = F.cross_entropy(ref(x), tgt)
        loss_r.backward()
        opt_r.step()
        opt_r.zero_grad()
        torch.testing.assert_close(loss_l.cpu(), loss_r.detach(), msg=f"loss, step {step}")
        for (pname, pr), pl in zip(ref.named_parameters(), lz.parameters()):
            torch.testing.assert_close(
                pl.detach().cpu(), pr.detach(), msg=f"{pname}, {step}", atol=1e-5, rtol=1e-4
            )
        # (the first convolution's input needs no gradient: its backward has an absent output,
        # recorded in C++ too); the first step makes AdamW's state as data
        first = {"aten::zeros_like.default"} if step == 0 else set()
        assert set(py) <= first, f"step {step}: {py}"
