"""The native recorder's boxed fallback to Python (stage 2, kiln/frontends/lazy/native/fallback.py):
ops outside the C++ table are recorded by Python (or run on the values, as a counted forced sync),
so no op is lost.  Every result is compared with eager PyTorch on the CPU.

Skips (with the reason) where the recorder cannot be built: it needs g++ and PyTorch's headers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import check, device_recorder, recorder, run_native  # noqa: F401

import kiln
from kiln import metrics
from kiln.frontends.lazy import native
from kiln.frontends.lazy.native import fallback
from kiln.runtime import compiler


@pytest.fixture(scope="module", autouse=True)
def device_switch_off():
    """These tests drive the recorder directly (``native.tensor(t)``, stage 2) with the kiln
    device's switch off -- its rules for ops on device tensors (``_device_active``) differ -- so
    the device records with the Python recorder while they run, whatever the default is."""
    with device_recorder("python"):
        yield


def program(x, y, w, b, cpu_row):
    """Ops outside the C++ table (single- and multi-output, CPU tensor operands, structural and
    lifted floats, int results, decompositions) beside table ops taking tensor lists."""
    n = x.shape[-1]
    mx, arg = torch.max(x, dim=-1)
    srt, order = torch.sort(y, dim=0)
    return (
        torch.softmax(x * 2.0, dim=-1),
        F.log_softmax(y, dim=0),
        x.cumsum(0),
        mx,
        arg,
        srt,
        order,
        torch.cat([x, y], 0),
        torch.stack([x, y], 1),
        F.layer_norm(x, (n,), w, b, eps=1e-5),
        torch.clamp(x, min=-0.5) + x.clamp_max(0.25),
        x + cpu_row,  # a table op with a CPU tensor operand
        torch.zeros_like(x) + torch.ones_like(y) * 3.0,
        x.masked_fill(x > 0, 1.5),
        torch.index_select(x, 1, torch.tensor([n - 1, 0])),
        F.gelu(x, approximate="tanh") - F.leaky_relu(y, 0.2),
    )


@pytest.mark.parametrize("shape", [(7, 13), (1, 1), (0, 5), (3, 1), (1, 9)])
def test_ops_outside_the_table_match_eager_and_are_counted(shape):
    before = dict(fallback.counts)
    calls = native.load().python_calls()
    check(
        program,
        torch.randn(shape),
        torch.randn(shape),
        torch.randn(shape[-1]),
        torch.randn(shape[-1]),
        torch.randn(shape[-1]),
    )
    assert native.load().python_calls() > calls
    for op in ("aten::cumsum.default", "aten::max.dim", "aten::sort.default"):
        assert fallback.counts[op] == before.get(op, 0) + 1, op
    for op in ("aten::cat.default", "aten::stack.default"):  # tensor lists: recorded in C++
        assert fallback.counts[op] == before.get(op, 0), op


def test_noncontiguous_and_view_inputs_through_the_fallback():
    base = torch.randn(6, 8)
    check(
        lambda a, b, c: (torch.softmax(a, 0), b.cumsum(1), torch.cat([c, b], 0), a.t().cumsum(0)),
        base.t(),  # (8, 6) transposed
        base[:, ::2],  # strided
        torch.randn(1, 4).expand(6, 4),  # stride 0
    )
    # a table view (chain link) of a native tensor, then fallback ops on it
    check(lambda x: (torch.softmax(x.t(), 1), x.t().unsqueeze(0).cumsum(2)), torch.randn(5, 3))


def test_split_unbind_and_select_are_views():
    def f(x):
        a, b, c = x.split(2, 0)
        u = x.unbind(1)
        return (
            a * 2.0,
            b + c[:1],
            u[0] - u[2],
            x[1],
            x[:, 1:3].sum(1),
            x.narrow(1, 1, 2),
            x.diagonal(),
        )

    check(f, torch.randn(5, 4), exact=True)


def test_the_python_recipe_is_made_once_per_signature(monkeypatch):
    handler_cls = fallback.Handler
    made = []
    real = handler_cls.make_recipe
    monkeypatch.setattr(
        handler_cls, "make_recipe", lambda self, *a: made.append(a[0]) or real(self, *a)
    )

    def step(x, w, b):  # cumsum: outside the C++ table (softmax and layer norm are in it now)
        return torch.cumsum(torch.cumsum(x, -1) * 0.5 * w + b, 0).sum(0)

    inputs = (torch.randn(5, 11), torch.randn(11), torch.randn(11))
    _, c1 = run_native(step, *inputs)
    first = len(made)
    _, c2 = run_native(step, torch.randn(5, 11), *inputs[1:])
    assert len(made) == first  # same signatures: recorded without a meta run or Python template
    assert c2.graph_id == c1.graph_id and not c2.is_new
    _, c3 = run_native(step, torch.randn(6, 11), *inputs[1:])
    assert len(made) > first and c3.graph_id != c1.graph_id  # a new shape: new recipes


@pytest.mark.parametrize(
    "prog",
    [
        lambda x, w: torch.softmax(x @ w, -1).cumsum(0),
        lambda x, w: torch.max(x, 1)[0] + torch.cat([w.t(), w.t()], 1).sum(0)[:4],
        lambda x, w: F.layer_norm(x, (3,)) * 2.0,
    ],
    ids=["softmax_cumsum", "max_cat", "layer_norm"],
)
def test_same_graph_as_the_python_recorder(prog):
    """Nodes recorded by the Python fallback are the Python recorder's nodes: the converted graph's
    structural hash is among those the kiln device compiled for the same program."""
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    got, cut = run_native(prog, x, w)
    g = native.graph_of(cut.graph_id)
    dev = kiln.device()
    out = prog(x.to(dev), w.to(dev))
    kiln.mark_step()
    hashes = [e.source_graph_hash for e in compiler.executables()]
    assert g.hash in hashes, f"native graph not compiled by the kiln device:\n{g}"
    torch.testing.assert_close(got[0], prog(x, w))
    torch.testing.assert_close(out.cpu(), prog(x, w))


def _syncs() -> int:
    return sum(metrics.counters().get("syncs", {}).values())


def test_data_movement_forces_counted_syncs_with_eager_values():
    base = torch.randn(4, 5)
    x = native.tensor(base)
    y = torch.softmax(x * 3.0, 1)
    s0 = _syncs()
    c = y.cpu()  # _to_copy to the CPU: the step runs
    assert c.device.type == "cpu"
    torch.testing.assert_close(c, torch.softmax(base * 3.0, 1))
    assert _syncs() == s0 + 1
    item = (y.sum() * 2.0).item()
    assert item == pytest.approx((torch.softmax(base * 3.0, 1).sum() * 2.0).item(), rel=1e-6)
    nz = torch.nonzero(x > 0)  # a data-dependent shape: run on the values
    torch.testing.assert_close(native.cpu(nz), torch.nonzero(base > 0))
    assert "kiln" in repr(x * 2.0) and "tensor(" in repr(x * 2.0)
    assert _syncs() >= s0 + 3
    # recording goes on after the syncs, reading the values they computed
    z = (y + nz.shape[0]) * 0.5
    native.mark_step()
    torch.testing.assert_close(
        native.cpu(z), (torch.softmax(base * 3.0, 1) + torch.nonzero(base > 0).shape[0]) * 0.5
    )


def test_in_place_ops_run_on_the_values_and_reach_every_alias():
    base = torch.randn(4, 6)
    x = native.tensor(base.clone())
    y = x * 2.0  # pending
    yt = y.t()  # a table view of it (chain link)
    row = y[1]  # select: a table view too
    y.add_(1.0)  # in place: the pending step runs, then the write lands in y's value
    yt.mul_(3.0)  # through the transposed view
    row.zero_()
    d = y.detach()  # no node: same storage
    w = (d + yt.t()) * 0.5
    native.mark_step()
    want = base * 2.0
    want.add_(1.0)
    want.t().mul_(3.0)
    want[1].zero_()
    torch.testing.assert_close(native.cpu(y), want)
    torch.testing.assert_close(native.cpu(yt), want.t())
    torch.testing.assert_close(native.cpu(w), (want + want) * 0.5)
    torch.testing.assert_close(native.cpu(x), base * 1.0)  # x untouched


def test_random_ops_are_nodes_seeded_by_a_graph_input_drawn_under_the_seed():
    # (stage 5: random ops are graph nodes; the graph seeds them from its seed input, drawn from
    # the CPU generator as the Python recorder draws it -- docs/native_recorder.md)
    base = torch.randn(8, 8)
    torch.manual_seed(3)
    got, _ = run_native(lambda x: F.dropout(x * 1.0, 0.5) + torch.rand_like(x), base)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    torch.manual_seed(seed)
    want = F.dropout(base * 1.0, 0.5) + torch.rand_like(base)
    torch.testing.assert_close(got[0], want)


def test_unsupported_in_place_reshape_and_other_devices_raise_and_recording_goes_on():
    x = native.tensor(torch.randn(3, 4))
    with pytest.raises(NotImplementedError, match="stage 3"):
        x.resize_(2, 6)
    with pytest.raises(NotImplementedError, match="stage 3"):
        torch.add(x, 1.0, out=native.tensor(torch.empty(3, 4)))
    dev = kiln.device()
    with pytest.raises(RuntimeError, match="kiln"):
        torch.cat([x, torch.randn(3, 4).to(dev)])
    kiln.mark_step()
    y = torch.softmax(x, 1)
    native.mark_step()
    torch.testing.assert_close(native.cpu(y), torch.softmax(native.cpu(x), 1))


def test_without_a_handler_ops_outside_the_table_raise_naming_the_op():
    mod = native.load()
    mod.set_fallback(None)
    try:
        x = native.tensor(torch.randn(4, 4))
        with pytest.raises(NotImplementedError, match="aten::cumsum"):
            x.cumsum(0)
        y = x * 2.0
    finally:
        mod.set_fallback(native._handler[0])  # the handler load() installed, as it was
    native.mark_step()
    torch.testing.assert_close(native.cpu(y), native.cpu(x) * 2.0)


# ---- whole programs: the table and the fallback together ----------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, d: int = 12, heads: int = 2, vocab: int = 23) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.att = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        h = self.ln1(x)
        a, _ = self.att(h, h, h, need_weights=False)
        x = x + a
        x = x + self.mlp(self.ln2(x))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1)), logits


@pytest.mark.parametrize("batch,seq", [(3, 7), (1, 1)])
def test_a_transformer_block_forward_matches_eager(batch, seq):
    torch.manual_seed(0)
    m = _Block().eval()
    idx, tgt = torch.randint(0, 23, (batch, seq)), torch.randint(0, 23, (batch, seq))
    syncs = _syncs()
    with torch.no_grad():
        want = m(idx, tgt)
        params = {k: native.tensor(v.detach().clone()) for k, v in m.state_dict().items()}
        got = torch.func.functional_call(m, params, (native.tensor(idx), native.tensor(tgt)))
        native.mark_step()
    assert _syncs() == syncs  # recorded whole: no op ran on values
    for g, w in zip(got, want):
        torch.testing.assert_close(native.cpu(g), w)


def test_a_training_step_matches_eager_and_the_second_step_is_recognised():
    """Forward, backward (the autograd engine's ops reach the recorder too) and an SGD update:
    loss, gradients and updated parameters equal eager's; the same step again is the same graph."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3)
    )
    state = {k: v.detach().clone() for k, v in m.named_parameters()}
    cuts = []
    for _ in range(2):
        x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
        ps = {k: native.tensor(v).requires_grad_() for k, v in state.items()}
        loss = F.cross_entropy(
            torch.func.functional_call(m, ps, (native.tensor(x),)), native.tensor(y)
        )
        loss.backward()
        with torch.no_grad():
            new = {k: p - 0.1 * p.grad for k, p in ps.items()}
        cuts.append(native.mark_step())
        leaves = {k: v.clone().requires_grad_() for k, v in state.items()}
        ref = F.cross_entropy(torch.func.functional_call(m, leaves, (x,)), y)
        refs = dict(zip(state, torch.autograd.grad(ref, list(leaves.values()))))
        torch.testing.assert_close(native.cpu(loss), ref.detach())
        for k, p in ps.items():
            torch.testing.assert_close(native.cpu(p.grad), refs[k])
            torch.testing.assert_close(native.cpu(new[k]), state[k] - 0.1 * refs[k])
        state = {k: native.cpu(v).clone() for k, v in new.items()}
    assert cuts[1].graph_id == cuts[0].graph_id and not cuts[1].is_new


def test_an_error_in_the_fallback_during_backward_is_raised_and_recording_goes_on():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g.resize_(9)  # in-place resize: not supported yet

    base = torch.randn(3, 3)
    x = native.tensor(base).requires_grad_()
    with pytest.raises(NotImplementedError, match="stage 3"):
        Bad.apply(x).sum().backward()
    z = x.detach() * 3.0
    native.mark_step()
    torch.testing.assert_close(native.cpu(z), base * 3.0)


def test_copy_from_the_cpu_into_a_whole_tensor_is_an_upload_without_a_sync():
    """``dst.copy_(cpu)`` over a whole native storage takes the value with no node and no sync;
    work recorded before it reads the old value, aliases and views see the new one (as eager)."""
    old, new = torch.randn(4, 5), torch.randn(4, 5)
    x = native.tensor(old.clone())
    y = (x + 1.0) * 2.0  # pending, reads the old value
    alias = x.detach()
    view = x.t()
    pending = x * 3.0
    pending.copy_(new)  # over a pending computed value
    syncs = _syncs()
    calls = dict(fallback.counts)
    x.copy_(new)
    assert _syncs() == syncs  # nothing ran
    # served in C++ (record.h's served_here): no Python fallback call
    assert fallback.counts["aten::copy_.default"] == calls.get("aten::copy_.default", 0)
    z = x * 0.5 + alias + view.t()
    native.mark_step()
    torch.testing.assert_close(native.cpu(y), (old + 1.0) * 2.0)
    torch.testing.assert_close(native.cpu(z), new * 0.5 + new + new)
    torch.testing.assert_close(native.cpu(pending), new)
    torch.testing.assert_close(native.cpu(view), new.t())
    # not a whole storage (a view), another shape (broadcast), another dtype: run on the values
    view.copy_(torch.ones(5, 4))
    x[1].copy_(torch.zeros(5))
    alias.copy_(torch.full((5,), 2.0))
    want = torch.full((4, 5), 2.0)
    torch.testing.assert_close(native.cpu(x), want)
    x.copy_(torch.arange(20, dtype=torch.int64).view(4, 5))
    torch.testing.assert_close(native.cpu(x), torch.arange(20.0).view(4, 5))


def test_ops_asked_for_a_cpu_result_return_cpu_tensors():
    base = torch.randn(3, 4)
    x = native.tensor(base)
    y = x * 2.0
    for make in (
        lambda t: torch.zeros_like(t, device="cpu"),
        lambda t: torch.full_like(t, 7.0, device="cpu"),
        lambda t: t.to("cpu", torch.float64),
        lambda t: t.cpu().t(),
    ):
        got, want = make(y), make(base * 2.0)
        assert got.device.type == "cpu" and got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    z = torch.zeros_like(y) + y  # no device: a native tensor
    native.mark_step()
    torch.testing.assert_close(native.cpu(z), base * 2.0)


def test_in_place_views_and_matmul_with_vectors():
    """``squeeze_``/``t_``/... (matmul of a vector uses ``squeeze_`` on its result): the tensor
    takes the out-of-place view's geometry; other tensors on its storage keep theirs."""

    def f(x, m, v):
        y = x * 2.0
        keep = y.detach()  # same storage, its own geometry
        y.squeeze_(0)
        y.t_()
        z = y + 1.0
        y.unsqueeze_(0)
        y.transpose_(1, 2)
        return y, z, keep, m @ v, v @ m.t(), v @ v

    check(f, torch.randn(1, 4, 3), torch.randn(5, 3), torch.randn(3), exact=True)


def test_an_op_with_a_none_output_among_tensor_outputs():
    """``native_layer_norm_backward`` without a weight returns (grad_input, None, grad_bias): a
    None output is kept in its place (it was taken for a tensor slot)."""
    x, g = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    mean = x.mean(-1, keepdim=True)
    rstd = (x.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    bias = torch.randn(4)

    def bwd(g, x, mean, rstd, bias):
        gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
            g, x, [4], mean, rstd, None, bias, [True, False, True]
        )
        assert gw is None
        return gi, gb

    check(bwd, g, x, mean, rstd, bias)
