"""Random ops on the native recorder as graph nodes (docs/native_recorder.md, stage 5): the seed a
graph input drawn as the Python recorder draws it, so a step under ``torch.manual_seed`` gives the
Python recorder's values (both draw from a generator seeded by that input, not eager's numbers),
the same graph, no forced sync and no new graph per step; ``set_rng_state`` replay for activation
checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _native_testlib import native_device  # noqa: F401 - the module fixture
from torch.utils.checkpoint import checkpoint

import kiln
from kiln import metrics
from kiln.frontends.lazy import native, trace
from kiln.frontends.lazy.tensor import LazyTensor
from kiln.ir.ops import Category

dev = kiln.device()
pytestmark = pytest.mark.usefixtures("native_device")


def on(recorder: str, fn, *args):
    """``fn(*args)`` with ``recorder`` as the kiln device's recorder after ``manual_seed(7)``:
    its results on the CPU, the hash of the graph it ran (None: it ran none)."""
    kiln.config.update(lazy_recorder=recorder)
    try:
        kiln.mark_step()
        torch.manual_seed(7)
        before = metrics.get("graphs_executed")
        outs = fn(*args)
        kiln.mark_step()
        ran = metrics.get("graphs_executed") - before
        cpu = [o.cpu() for o in outs]
        h = None
        if ran:
            g = native.last_graph() if recorder == "native" else trace._last_entry.graph
            h = g.hash
        return cpu, h
    finally:
        kiln.config.update(lazy_recorder="native")


def both(fn, *args, same_graph: bool = True):
    got, hn = on("native", fn, *args)
    want, hp = on("python", fn, *args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    if same_graph:
        assert hn == hp, "not the Python recorder's graph"
    return got


RANDOM = {
    "dropout": lambda x: [F.dropout(x * 1, 0.3, training=True)],
    "native_dropout": lambda x: list(torch.ops.aten.native_dropout(x * 1, 0.4, True)),
    "bernoulli_p": lambda x: [torch.bernoulli(x * 1, 0.25)],
    "bernoulli_probs": lambda x: [torch.bernoulli(torch.sigmoid(x))],
    "rand_like": lambda x: [torch.rand_like(x) + x],
    "randn_like": lambda x: [torch.randn_like(x) * x],
    "randint_like": lambda x: [torch.randint_like(x, 0, 10)],
    "normal": lambda x: [torch.normal(x, 0.5)],
    "uniform_": lambda x: [(x * 1).uniform_(-2, 3)],
    "normal_": lambda x: [(x * 1).normal_()],
    "multinomial": lambda x: [torch.multinomial(x.abs() + 0.1, 3)],
    "sdpa_dropout": lambda x: [
        F.scaled_dot_product_attention(x[None] * 1, x[None], x[None], dropout_p=0.3)
    ],
    "two_draws": lambda x: [F.dropout(x, 0.5) + torch.rand_like(x), torch.randn_like(x)],
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_ops_are_nodes_with_the_python_recorders_values_and_graph(name):
    x = torch.randn(6, 5)
    metrics.reset()
    kiln.config.update(lazy_recorder="native")
    got, _ = on("native", lambda t: RANDOM[name](t.to(dev)), x)
    assert metrics.get("forced_syncs") == 0, "a random op forced a sync"
    assert metrics.get("graphs_executed") == 1
    again, _ = on("native", lambda t: RANDOM[name](t.to(dev)), x)  # reproducible
    for g, a in zip(got, again):
        torch.testing.assert_close(g, a, rtol=0, atol=0)
    both(lambda t: RANDOM[name](t.to(dev)), x)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (7,), (5, 3)])
@pytest.mark.parametrize("p", [0.0, 1.0, 0.5])
def test_dropout_edge_probabilities_and_sizes(shape, p):
    x = torch.randn(shape)
    # (p=1 is ``x * zeros(())`` in ATen: a factory, a node on both recorders since stage 8)
    (got,) = both(lambda t: [F.dropout(t.to(dev), p, training=True)], x)
    assert got.shape == x.shape
    if p == 0.0:
        torch.testing.assert_close(got, x, rtol=0, atol=0)
    elif p == 1.0:
        torch.testing.assert_close(got, torch.zeros_like(x), rtol=0, atol=0)
    else:  # each element dropped or scaled by 2
        assert bool(((got == 0) | torch.isclose(got, 2 * x)).all())


def test_non_contiguous_input():
    x = torch.randn(4, 6)
    both(lambda t: [F.dropout(t.to(dev).t(), 0.5), torch.rand_like(t.to(dev).t())], x)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(9, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3)
    )


def _train(recorder: str, steps: int, train: bool = True):
    kiln.config.update(lazy_recorder=recorder)
    try:
        m = _model().to(dev)
        m.train(train)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(8, 9, generator=gen) for _ in range(steps)]
        torch.manual_seed(5)
        losses, syncs, graphs = [], [], []
        for k, x in enumerate(xs):
            metrics.reset()
            loss = m(x.to(dev)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            kiln.mark_step()
            syncs.append(metrics.get("forced_syncs"))
            graphs.append(metrics.get("graphs_compiled") + metrics.get("cache_hits_disk"))
            losses.append(loss.cpu())
        return losses, [p.cpu() for p in m.parameters()], syncs, graphs
    finally:
        kiln.config.update(lazy_recorder="native")


def test_dropout_training_step_equals_the_python_recorder_with_no_sync_and_one_graph():
    losses, params, syncs, graphs = _train("native", 4)
    assert syncs == [0, 0, 0, 0]
    assert sum(graphs[1:]) == 0, f"steady steps compiled graphs: {graphs}"
    plosses, pparams, _, _ = _train("python", 4)
    for a, b in zip(losses + params, plosses + pparams):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len({float(v) for v in losses}) == 4


def test_eval_mode_records_no_random_node_and_matches_eager():
    losses, params, syncs, _ = _train("native", 2, train=False)
    assert syncs == [0, 0]
    g = native.last_graph()
    assert not any(n.kwarg("role") == "seed" for n in g.nodes)
    m = _model().eval()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for k in range(2):
        loss = m(torch.randn(8, 9, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(losses[k], loss.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(params, m.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_seed_is_a_graph_input():
    x = torch.ones(50, device=dev)
    kiln.mark_step()
    F.dropout(x, 0.5).sum()
    y = F.dropout(x, 0.5)
    kiln.mark_step()
    seeds = [n for n in native.last_graph().nodes if n.kwarg("role") == "seed"]
    assert len(seeds) == 1 and seeds[0].op == "scalar"
    assert native.is_native(y)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_replays_the_forwards_dropout_mask(reentrant):
    def step():
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 6).to(dev)
        x = torch.randn(4, 6).to(dev).requires_grad_()
        torch.manual_seed(3)
        out = checkpoint(
            lambda t: F.dropout(lin(t), 0.5, training=True) * 2,
            x,
            use_reentrant=reentrant,
        )
        out.sum().backward()
        return [out, x.grad, lin.weight.grad]

    got = both(step)
    # the gradient is the forward's mask: zero exactly where the output is
    dropped = got[0] == 0
    assert bool(dropped.any()) and not bool(dropped.all())


def test_python_recorder_tensors_are_untouched():
    kiln.config.update(lazy_recorder="python")
    try:
        t = F.dropout(torch.ones(10, device=dev), 0.5)
        assert type(t) is LazyTensor
        kiln.mark_step()
    finally:
        kiln.config.update(lazy_recorder="native")


FACTORIES = {
    "randn": lambda: [torch.randn(4, 5, device=dev)],
    "rand": lambda: [torch.rand(3, device=dev)],
    "randint_low": lambda: [torch.randint(-3, 9, (6,), device=dev)],
    "randint": lambda: [torch.randint(9, (2, 3), device=dev)],
    "randperm": lambda: [torch.randperm(7, device=dev)],
    "randn_float64": lambda: [torch.randn(2, 3, dtype=torch.float64, device=dev)],
    "rand_odd_then_used": lambda: [torch.rand(5, 1, 3, device=dev) * 2 + 1],
    "randn_size_0": lambda: [torch.randn(0, 3, device=dev)],
    "randn_1_element": lambda: [torch.randn((), device=dev)],
    "two_factories": lambda: [torch.randn(3, device=dev), torch.randint(0, 2, (3,), device=dev)],
    # normal with a size: ATen's ``empty`` (a node) and a ``normal_``, recorded as a seeded node
    # by the in-place path
    "normal_size": lambda: [torch.normal(0.5, 2.0, (3, 2), device=dev)],
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_random_factories_are_seeded_nodes_with_the_python_recorders_values(name):
    """``torch.randn(..., device=kiln)`` and the other random factories: one seeded random node
    each (not a draw from the CPU generator at the call), no forced sync, reproducible under
    ``manual_seed``, the Python recorder's values bit for bit and its graph."""
    fn = FACTORIES[name]
    metrics.reset()
    got, _ = on("native", fn)
    assert metrics.get("forced_syncs") == 0
    assert metrics.get("graphs_executed") == 1, "no Kiln graph ran"
    g = native.last_graph()
    assert [n.op for n in g.nodes if n.kwarg("role") == "seed"] == ["scalar"]
    assert any(n.category is Category.RANDOM for n in g.nodes)
    again, _ = on("native", fn)
    for a, b in zip(got, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    want = both(fn)
    for a, w in zip(want, _on_cpu(fn)):  # eager's shapes and dtypes
        assert a.shape == w.shape and a.dtype == w.dtype
    if name == "randperm":
        assert sorted(got[0].tolist()) == list(range(7))
    if name == "randint_low":
        assert bool(((got[0] >= -3) & (got[0] < 9)).all())


def _on_cpu(fn):
    """``fn``'s results with ``device=kiln`` replaced by the CPU (the module's ``dev``)."""
    global dev
    saved = dev
    dev = torch.device("cpu")
    try:
        return fn()
    finally:
        dev = saved


def test_a_random_factory_each_step_is_a_new_seed_not_a_new_graph():
    """Noise drawn with ``torch.randn(..., device=kiln)`` in every step of a loop: one graph
    compiled, new values every step, the same values as the Python recorder's loop."""

    def loop(recorder):
        kiln.config.update(lazy_recorder=recorder)
        try:
            kiln.mark_step()
            torch.manual_seed(11)
            w = torch.ones(4, 3, device=dev)
            kiln.mark_step()  # (the ones node: a graph of its own)
            outs, compiled = [], []
            for _ in range(3):
                metrics.reset()
                w = w * 0.5 + torch.randn(4, 3, device=dev)
                kiln.mark_step()
                compiled.append(metrics.get("graphs_compiled") + metrics.get("cache_hits_disk"))
                outs.append(w.cpu())
            return outs, compiled
        finally:
            kiln.config.update(lazy_recorder="native")

    got, compiled = loop("native")
    assert sum(compiled[1:]) == 0, compiled
    assert not torch.equal(got[1] - 0.5 * got[0], got[2] - 0.5 * got[1])
    want, _ = loop("python")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


VALUE_FACTORIES = {
    "zeros": lambda: [torch.zeros(3, 4, device=dev)],
    "ones_int": lambda: [torch.ones(5, dtype=torch.int64, device=dev)],
    "full": lambda: [torch.full((2, 3), 1.5, device=dev)],
    "full_bool": lambda: [torch.full((3,), True, device=dev)],
    "full_size_0": lambda: [torch.full((2, 0), 7.0, device=dev)],
    "arange": lambda: [torch.arange(7, device=dev)],
    "arange_float_step": lambda: [torch.arange(0.5, 3.0, 0.25, device=dev)],
    "linspace": lambda: [torch.linspace(-1, 1, 9, device=dev)],
    "eye": lambda: [torch.eye(3, 5, device=dev)],
    "scalar_tensor": lambda: [torch.scalar_tensor(2.5, device=dev)],
    "mask_used": lambda: [torch.ones(4, 4, device=dev).tril() * torch.arange(4, device=dev)],
}


@pytest.mark.parametrize("name", sorted(VALUE_FACTORIES))
def test_factories_kiln_computes_are_graph_nodes_equal_to_eager(name):
    """``torch.zeros(..., device=kiln)`` and the other factories Kiln lowers
    (``Category.FACTORY``): graph nodes, as on the Python recorder (same graph), no seed, no
    forced sync, eager's values exactly."""
    fn = VALUE_FACTORIES[name]
    metrics.reset()
    got, _ = on("native", fn)
    assert metrics.get("forced_syncs") == 0
    assert metrics.get("graphs_executed") == 1, "no Kiln graph ran"
    g = native.last_graph()
    assert any(n.category is Category.FACTORY for n in g.nodes), str(g)
    assert not any(n.kwarg("role") == "seed" for n in g.nodes)
    both(fn)
    for a, w in zip(got, _on_cpu(fn)):
        assert a.dtype == w.dtype
        torch.testing.assert_close(a, w, rtol=0, atol=0)


def test_a_factory_the_value_of_which_changes_is_another_graph_not_a_stale_one():
    """A factory's float arguments are part of its node (structural, as on the Python recorder):
    another fill value or range is another node, never the first call's values."""
    kiln.mark_step()
    a = torch.full((2,), 1.5, device=dev)
    b = torch.full((2,), -3.0, device=dev)
    c = torch.arange(0.0, 1.0, 0.5, device=dev)
    d = torch.arange(0.0, 2.0, 0.5, device=dev)
    kiln.mark_step()
    assert a.cpu().tolist() == [1.5, 1.5] and b.cpu().tolist() == [-3.0, -3.0]
    assert c.cpu().tolist() == [0.0, 0.5] and d.cpu().tolist() == [0.0, 0.5, 1.0, 1.5]


def test_empty_is_a_graph_node_and_to_device_still_an_upload():
    """``torch.empty`` / ``empty_strided`` with ``device=kiln``: graph nodes, as on the Python
    recorder (eager's shape, dtype and strides; the values are uninitialized on both sides).
    ``.to(dev)`` allocates through ``empty`` and then uploads: its value is taken at the call
    (a later change to the CPU tensor is not seen) and the dead node is pruned from the graph."""
    kiln.mark_step()
    metrics.reset()
    e = torch.empty(3, 4, dtype=torch.float64, device=dev)
    s = torch.empty_strided((2, 3), (1, 2), device=dev)
    z = torch.empty(0, 5, device=dev)
    assert native.trace_len() > 0  # recorded, not made on the CPU
    kiln.mark_step()
    g = native.last_graph()
    assert sorted(n.op for n in g.nodes if n.category is Category.FACTORY) == [
        "empty.memory_format",
        "empty.memory_format",
        "empty_strided.default",
    ], str(g)
    for got, want in [
        (e, torch.empty(3, 4, dtype=torch.float64)),
        (s, torch.empty_strided((2, 3), (1, 2))),
        (z, torch.empty(0, 5)),
    ]:
        c = got.cpu()
        assert c.shape == want.shape and c.dtype == want.dtype and got.stride() == want.stride()
    src = torch.randn(4, 3)
    lx = src.to(dev)
    y = lx * 2
    src.add_(100)  # after the upload: not seen
    kiln.mark_step()
    assert not any(n.category is Category.FACTORY for n in native.last_graph().nodes)
    torch.testing.assert_close(y.cpu(), (src - 100) * 2)
    assert metrics.get("forced_syncs") == 0
