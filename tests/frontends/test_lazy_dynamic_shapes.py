"""Shape-generic lazy graphs (kiln.frontends.lazy.dynamic): a step whose only change is a size
reuses one compiled graph, and its results are eager PyTorch's at every size."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln import metrics
from kiln.frontends.lazy import dynamic

dev = kiln.device()
VOCAB, DIM, HEADS = 40, 32, 4


@pytest.fixture(autouse=True)
def _fresh_families():
    """Each test sees its own families of graphs (the counts below start from nothing)."""
    dynamic.clear()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # no q/k/v bias: the key bias's gradient is zero up to rounding noise, and AdamW's first
        # step turns the noise's sign into a +-lr update that no two implementations share
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, L, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, L, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.block, self.ln = Block(), nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.block(x)))


def _step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, y: torch.Tensor):
    logits = model(idx)
    # summed over tokens (a mean over zero tokens would be NaN in eager as well)
    loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction="sum") / idx.shape[0]
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return loss, grads


def _compiles() -> int:
    return metrics.get("graphs_compiled") + metrics.get("cache_hits_disk")


def _check(ref, lz, loss_r, loss_l, grads_r, grads_l, length) -> None:
    def msg(m: str) -> str:
        return f"{m}\n(sequence length {length})"

    torch.testing.assert_close(loss_l.cpu(), loss_r.detach(), rtol=1e-5, atol=1e-5, msg=msg)
    for gr, gl in zip(grads_r, grads_l):
        torch.testing.assert_close(gl.cpu(), gr, rtol=1e-4, atol=1e-5, msg=msg)
    for p, q in zip(ref.parameters(), lz.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach(), rtol=1e-4, atol=1e-5, msg=msg)


def test_ten_sequence_lengths_compile_two_graphs_and_match_eager():
    torch.manual_seed(0)
    ref = TinyLM()
    lz = copy.deepcopy(ref).to(dev)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)  # library defaults: foreach on kiln
    opt_l = torch.optim.AdamW(lz.parameters(), lr=1e-2)
    lengths = [7, 12, 5, 33, 9, 2, 17, 64, 3, 10]

    def run(length: int) -> None:
        idx, y = torch.randint(0, VOCAB, (2, length)), torch.randint(0, VOCAB, (2, length))
        loss_r, grads_r = _step(ref, opt_r, idx, y)
        loss_l, grads_l = _step(lz, opt_l, idx.to(dev), y.to(dev))
        kiln.mark_step()
        _check(ref, lz, loss_r, loss_l, grads_r, grads_l, length)

    metrics.reset()
    # the first step creates AdamW's state (``zeros_like(param)``: made as data, not recorded), so
    # its graph is the steady step's: one graph at the first length, then one shape-generic graph
    # for all the others
    run(lengths[0])
    # parameters and optimizer state keep their buffers from the first step on
    state = [t for s in opt_l.state.values() for t in s.values() if t.device == dev]
    assert len(state) == 2 * len(list(lz.parameters()))
    ptrs = [t.data_ptr() for t in (*lz.parameters(), *state)]
    for length in lengths:
        run(length)
    assert _compiles() <= 2, metrics.counters()
    assert metrics.get("shape_generic_graphs") == 1
    assert metrics.get("shape_generic_reuses") == len(set(lengths)) - 1
    assert [t.data_ptr() for t in (*lz.parameters(), *state)] == ptrs
    assert len(metrics.counters()["recompile_reasons"]) <= 2  # one per compile, no storm
    # the generic graph keeps Kiln's layer norm and (log_)softmax backward kernels (sizes read at
    # run time)
    assert not [f for f in metrics.counters()["fallbacks"] if "contract" in f]
    # sizes 1 and 0 are never symbolic (as in Dynamo): each gets its own graph, still exact
    for length in (1, 0, 1):
        run(length)
    assert _compiles() <= 4, metrics.counters()


def test_a_size_that_cannot_be_symbolic_keeps_one_graph_per_shape():
    # the reduced dim is an ``int`` argument (a dim index), not a size: never made symbolic
    metrics.reset()
    for shape, dim in (((2, 3, 4, 5), 2), ((2, 3, 4, 6), 3), ((2, 3, 4, 7), 3)):
        x = torch.randn(shape)
        got = (x.to(dev) * 2).sum(dim)
        kiln.mark_step()
        torch.testing.assert_close(got.cpu(), (x * 2).sum(dim))
    # the second (new dim index) is refused and compiles on its own; the third differs from the
    # second only in a size: one generic graph from those two
    assert metrics.get("shape_generic_refused") == 1
    assert metrics.get("shape_generic_graphs") == 1


def test_sizes_that_break_the_generic_graphs_relation_get_a_more_general_one():
    # (m, 3) @ (3, n): m and n are one symbol after (5, 5) and (7, 7) (equal sizes share one, as
    # in Dynamo); (6, 8) is not an instance of that graph and gets one with two symbols
    metrics.reset()
    for m, n in ((5, 5), (7, 7), (6, 8), (9, 9), (10, 4)):
        a, b = torch.randn(m, 3), torch.randn(3, n)
        got = torch.relu(a.to(dev) @ b.to(dev)) + 1
        kiln.mark_step()
        torch.testing.assert_close(got.cpu(), torch.relu(a @ b) + 1)
    assert metrics.get("shape_generic_graphs") == 2
    assert metrics.get("shape_generic_reuses") == 4  # all but the first


def test_non_contiguous_inputs_and_view_sizes_over_lengths():
    metrics.reset()
    for length in (4, 6, 11, 8):
        x = torch.randn(length, 3, 5).transpose(0, 2)  # non-contiguous (5, 3, L)
        got = (x.to(dev).reshape(15, length) * 3).softmax(-1).view(5, 3 * length)[:, 2:]
        kiln.mark_step()
        want = (x.reshape(15, length) * 3).softmax(-1).view(5, 3 * length)[:, 2:]
        torch.testing.assert_close(got.cpu(), want)
    assert metrics.get("shape_generic_reuses") >= 2


def test_sizes_computed_from_a_length_products_and_offsets():
    # reshape to L*L (an s0*s0 size argument), rows 1.. of an L x L product (L - 1 rows)
    metrics.reset()
    for length in (4, 6, 9, 5):
        a = torch.randn(length, 3)
        want = ((a @ a.t()).reshape(length * length) * 2).view(length, length)[1:].sum(0)
        got = ((a.to(dev) @ a.to(dev).t()).reshape(length * length) * 2).view(length, length)
        got = got[1:].sum(0)
        kiln.mark_step()
        torch.testing.assert_close(got.cpu(), want)
    assert metrics.get("shape_generic_reuses") == 3


def test_a_linear_bias_gradient_over_sizes_in_a_generic_graph():
    """A 3-D linear layer's bias gradient is a sum over the leading dims of a reshape; the layout
    pass rewrote it to a sum of the source and a view to the result's type, whose sizes were a
    generic graph's symbolic text ("s1"): ``view()`` raised TypeError at the second size and the
    family stayed broken for every later size (found by the fuzzer)."""
    metrics.reset()
    for b, t, i, o in ((2, 1, 3, 2), (3, 1, 4, 5), (4, 1, 5, 3), (2, 1, 3, 2), (5, 3, 3, 2)):
        xs = [torch.randn(b, t, i), torch.randn(o, i), torch.randn(o)]
        xs += [torch.randn(o, i).t(), torch.randn(i)]  # a transposed weight
        grads = []
        for d in ("cpu", dev):
            ps = [
                x.detach().to(d).requires_grad_() if d == dev else x.clone().requires_grad_()
                for x in xs
            ]
            v = torch.log_softmax(F.linear(torch.log_softmax(ps[0], -1), ps[1], ps[2]), -1)
            out = F.linear(v, ps[3], ps[4])
            (out.sum() + v.sum()).backward()
            if d == dev:
                kiln.mark_step()
            grads.append([p.grad.cpu() for p in ps] + [out.detach().cpu()])
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want)
    assert metrics.get("shape_generic_reuses") >= 1


def _norm_step(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x * 2 + 1, x.shape[-1:]).relu().sum(1)


def test_a_first_length_of_one_does_not_block_the_family():
    metrics.reset()
    for length in (1, 5, 7, 9):
        x = torch.randn(3, length, 4)
        got = _norm_step(x.to(dev))
        kiln.mark_step()
        torch.testing.assert_close(got.cpu(), _norm_step(x))
    assert metrics.get("shape_generic_graphs") == 1  # from lengths 5 and 7
    assert metrics.get("shape_generic_reuses") == 2  # 7 and 9


def test_batch_and_length_changing_get_a_second_generic_graph():
    metrics.reset()
    for batch, length in ((2, 5), (2, 7), (3, 6), (4, 9), (2, 11), (5, 5)):
        x = torch.randn(batch, length, 4)
        got = _norm_step(x.to(dev))
        kiln.mark_step()
        torch.testing.assert_close(got.cpu(), _norm_step(x))
    # length symbolic from (2, 5) and (2, 7); batch too from (2, 5) and (3, 6); then reuse
    assert metrics.get("shape_generic_graphs") == 2
    assert metrics.get("shape_generic_reuses") == 5


def test_a_generic_graph_that_fails_to_compile_falls_back_to_per_shape_graphs(monkeypatch):
    from kiln.frontends.lazy import dynamic

    real = dynamic.compile_graph

    def no_symbols(g):
        if any(n.op == "scalar" and n.types[0].py == "int" for n in g.nodes):
            raise RuntimeError("symbolic sizes refused by this test")
        return real(g)

    # both recorders' mark_step compile through lazy.dynamic.compiled
    monkeypatch.setattr(dynamic, "compile_graph", no_symbols)
    metrics.reset()
    for length in (5, 7, 9, 7):
        x = torch.randn(length, 6)
        got = (x.to(dev) * 3).softmax(-1)
        kiln.mark_step()
        torch.testing.assert_close(got.cpu(), (x * 3).softmax(-1))
    fallbacks = metrics.counters()["fallbacks"]
    assert any("symbolic sizes refused by this test" in k for k in fallbacks), fallbacks
    assert metrics.get("shape_generic_reuses") == 1  # only the attempt at length 7


def test_switch_off_compiles_one_graph_per_shape():
    kiln.config.update(dynamic_shapes=False)
    try:
        metrics.reset()
        for length in (21, 22, 23):
            got = (torch.ones(length).to(dev) * 2).sum()
            kiln.mark_step()
            assert got.item() == 2 * length
        assert metrics.get("shape_generic_graphs") == 0
    finally:
        kiln.config.update(dynamic_shapes=True)


@pytest.mark.parametrize(
    "pair,expr,at9,text",
    [
        ((10, 14), (2, (0,), 0), 18, "2*s0"),  # batch x length
        ((4, 6), (1, (0,), -1), 8, "s0 - 1"),  # a shifted sequence
        ((25, 49), (1, (0, 0), 0), 81, "s0*s0"),  # an L x L mask, flattened
        ((11, 3), None, None, None),  # no expression of s0 (5 -> 7) fits
    ],
)
def test_expressions_of_a_symbol(pair, expr, at9, text):
    assert dynamic._express(pair[0], pair[1], [(5, 7)]) == expr
    if expr is not None:
        assert dynamic.evaluate(expr, [9]) == at9
        assert dynamic.text(expr) == text
