"""Kiln's CSE of the joint graph before the min-cut partition (kiln/frontends/compile/joint_cse.py):
golden cases and the same merges as torch's own CSE on real joint graphs."""

from __future__ import annotations

import collections
import copy
import operator

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.frontends.compile import backend
from kiln.frontends.compile.joint_cse import joint_cse

aten = torch.ops.aten


def _graph(build):
    """A graph made by ``build(graph, fake)``, each node's ``val`` computed on fake tensors."""
    g = torch.fx.Graph()
    mode = FakeTensorMode()
    with mode:
        build(g, mode)
    return g


def _placeholder(g, name, *shape):
    p = g.placeholder(name)
    p.meta["val"] = torch.empty(*shape)
    return p


def _call(g, target, *args, **kwargs):
    n = g.call_function(target, args, kwargs)
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    kw = {k: v.meta["val"] if isinstance(v, torch.fx.Node) else v for k, v in kwargs.items()}
    n.meta["val"] = target(*vals, **kw)
    return n


def _targets(g):
    return [n.target for n in g.nodes if n.op == "call_function"]


def test_duplicates_merge_and_their_users_follow():
    def build(g, _):
        w = _placeholder(g, "w", 4, 3)
        x = _placeholder(g, "x", 2, 3)
        t1 = _call(g, aten.t.default, w)
        t2 = _call(g, aten.t.default, w)  # the backward's transpose of the same weight
        y = _call(g, aten.mm.default, x, t1)
        z = _call(g, aten.mm.default, x, t2)  # now the same as y
        s = _call(g, aten.add.Tensor, y, z)
        g.output((s,))

    g = _graph(build)
    assert joint_cse(g) == 2
    assert _targets(g) == [aten.t.default, aten.mm.default, aten.add.Tensor]
    add = next(n for n in g.nodes if n.target is aten.add.Tensor)
    assert add.args[0] is add.args[1]


def test_keys_compare_whole_not_by_hash():
    # hash(-1) == hash(-2): both pairs merge all the same
    def build(g, _):
        x = _placeholder(g, "x", 4)
        outs = [_call(g, aten.unsqueeze.default, x, d) for d in (-2, -1, -2, -1)]
        g.output((_call(g, aten.add.Tensor, outs[2], outs[3]),))

    g = _graph(build)
    assert joint_cse(g) == 2
    add = next(n for n in g.nodes if n.target is aten.add.Tensor)
    assert [a.args[1] for a in add.args] == [-2, -1]


def test_numbers_compare_with_their_types():
    def build(g, _):
        x = _placeholder(g, "x", 4)
        a = _call(g, aten.mul.Tensor, x, 2)
        b = _call(g, aten.mul.Tensor, x, 2.0)  # another op on values: int vs float scalar
        g.output((_call(g, aten.add.Tensor, a, b),))

    g = _graph(build)
    assert joint_cse(g) == 0


def test_signed_zeros_stay_apart():
    def build(g, _):
        x = _placeholder(g, "x", 4)
        a = _call(g, aten.mul.Tensor, x, 0.0)
        b = _call(g, aten.mul.Tensor, x, -0.0)  # 0.0 == -0.0, but the products' zeros differ
        c = _call(g, aten.mul.Tensor, x, -0.0)  # b's value: merged
        g.output((_call(g, aten.add.Tensor, a, _call(g, aten.add.Tensor, b, c)),))

    g = _graph(build)
    assert joint_cse(g) == 1
    muls = [n for n in g.nodes if n.target is aten.mul.Tensor]
    assert [str(n.args[1]) for n in muls] == ["0.0", "-0.0"]


def test_no_merge_across_an_in_place_op():
    def build(g, _):
        x = _placeholder(g, "x", 4)
        a = _call(g, aten.relu.default, x)
        _call(g, aten.add_.Tensor, x, 1.0)  # x changes here
        b = _call(g, aten.relu.default, x)  # not a's value any more
        c = _call(g, aten.relu.default, x)  # b's value: merged
        g.output((_call(g, aten.add.Tensor, a, _call(g, aten.add.Tensor, b, c)),))

    g = _graph(build)
    assert joint_cse(g) == 1
    assert _targets(g).count(aten.relu.default) == 2


def test_random_and_uninitialized_ops_never_merge():
    def build(g, _):
        x = _placeholder(g, "x", 4)
        d1 = _call(g, aten.native_dropout.default, x, 0.5, True)
        d2 = _call(g, aten.native_dropout.default, x, 0.5, True)
        e1 = _call(g, aten.empty.memory_format, [4])
        e2 = _call(g, aten.empty.memory_format, [4])
        m1 = _call(g, operator.getitem, d1, 0)
        m2 = _call(g, operator.getitem, d2, 0)
        g.output((m1, m2, e1, e2))

    g = _graph(build)
    assert joint_cse(g) == 0


def test_values_that_share_an_outputs_storage_stay_apart():
    def build(g, _):
        x = _placeholder(g, "x", 4)
        a = _call(g, aten.relu.default, x)
        b = _call(g, aten.relu.default, x)  # returned beside a: eager gives two tensors
        g.output((a, b))

    g = _graph(build)
    assert joint_cse(g) == 0


def test_getitems_of_a_merged_multi_output_op_merge_too():
    def build(g, _):
        x = _placeholder(g, "x", 2, 8)
        w = _placeholder(g, "w", 8)
        n1 = _call(g, aten.native_layer_norm.default, x, [8], w, None, 1e-5)
        n2 = _call(g, aten.native_layer_norm.default, x, [8], w, None, 1e-5)
        y1 = _call(g, operator.getitem, n1, 0)
        y2 = _call(g, operator.getitem, n2, 0)
        g.output((_call(g, aten.add.Tensor, y1, y2),))

    g = _graph(build)
    assert joint_cse(g) == 2
    assert _targets(g).count(aten.native_layer_norm.default) == 1


class _Block(torch.nn.Module):
    """A transformer-like block: shared weights read by forward and backward, a causal mask."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.proj = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).split(32, dim=-1)
        att = (q @ k.transpose(-2, -1)) / 32**0.5
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return x + self.proj(torch.nn.functional.gelu(att @ v))


def test_same_merges_as_torchs_cse_on_joint_graphs(monkeypatch):
    from torch._functorch.compile_utils import fx_graph_cse

    seen = []
    partition = backend.min_cut_keeping_mutated_reads

    def spy(joint, joint_inputs, **kw):
        theirs = fx_graph_cse(copy.deepcopy(joint).graph)
        ours = copy.deepcopy(joint)
        erased = joint_cse(ours.graph)
        seen.append((erased, _multiset(theirs), _multiset(ours.graph)))
        return partition(joint, joint_inputs, **kw)

    monkeypatch.setattr(backend, "min_cut_keeping_mutated_reads", spy)
    torch._dynamo.reset()
    model = torch.nn.Sequential(_Block(), _Block())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="kiln")
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step(torch.randn(2, 8, 32))
    torch._dynamo.reset()
    assert seen
    for erased, theirs, ours in seen:
        # every merge torch's CSE makes, Kiln's makes; Kiln's makes more where torch's keys
        # collide: it looks duplicates up by their hash alone, and hash(-1) == hash(-2) in
        # CPython, so after `unsqueeze(a, -2)` no later `unsqueeze(a, -1)` merges (the causal
        # masks of the two blocks here)
        assert all(ours[op] <= n for op, n in theirs.items()) and set(ours) <= set(theirs)
    assert sum(e for e, _, _ in seen) > 0  # the weights' transposes, at least


def _multiset(g):
    return collections.Counter(str(n.target) for n in g.nodes)


# a cold first compile that imports none of Inductor's lowering: test_compile_optimizer_trace.py


def test_signed_zero_products_keep_their_signs_through_a_compiled_training_graph():
    # the joint graph (x requires grad) goes through the partition and its CSE: torch's own CSE
    # merges x * 0.0 and x * -0.0 (0.0 == -0.0), and 1 / (x * -0.0) became +inf (Inductor too)
    torch._dynamo.reset()

    def f(x):
        return torch.stack([1.0 / (x * 0.0), 1.0 / (x * -0.0)]) * x

    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    got = torch.compile(f, backend="kiln")(x)
    want = f(x)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert want[1].tolist() == [float("-inf")] * 3


@pytest.mark.parametrize(
    "shape",
    [(2, 8, 32), (0, 8, 32), (8, 128, 32)],  # tiny, zero-size batch, a real sequence length
    ids=["tiny", "zero_size", "seq128"],
)
def test_training_graph_with_duplicates_matches_eager_forward_and_gradients(shape):
    # the causal mask and the weights' transposes are computed by both blocks / both passes:
    # merged by the CSE before the partition; the input is a transposed (non-contiguous) view
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    ref = copy.deepcopy(model)
    base = torch.randn(shape[1], shape[0], shape[2])
    x = base.transpose(0, 1).requires_grad_()
    x_ref = base.transpose(0, 1).requires_grad_()
    assert x.numel() == 0 or not x.is_contiguous()  # an empty tensor counts as contiguous

    out = torch.compile(lambda t: model(t).square().mean(), backend="kiln")(x)
    want = ref(x_ref).square().mean()
    out.backward()
    want.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, equal_nan=True)
