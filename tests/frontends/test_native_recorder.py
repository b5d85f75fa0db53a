"""The native lazy recorder (kiln/frontends/lazy/native): ops recorded in C++, the graph
converted to Kiln IR, compiled and run; every result compared with eager PyTorch on the CPU.

Skips (with the reason) where the recorder cannot be built: it needs g++ and PyTorch's headers.
"""

from __future__ import annotations

import pytest
import torch
from _native_testlib import check, recorder, run_native  # noqa: F401

import kiln
from kiln.frontends.lazy import native, trace

# ---- forward results vs eager -----------------------------------------------------------------

SHAPES = [(7, 13), (1, 1), (0, 5), (3, 1), (1, 9)]


@pytest.mark.parametrize("shape", SHAPES)
def test_pointwise_chain(shape):
    def f(x, y):
        a = (x + 0.5) * 2 - y / 3.0
        b = torch.relu(a).exp().neg() + x.abs().sqrt()
        c = torch.maximum(torch.sigmoid(b), torch.tanh(y)) ** 2.0
        return c + torch.add(x, y, alpha=3), (x > 0.1), torch.where(x > y, x, y)

    check(f, torch.randn(shape), torch.randn(shape))


def test_broadcasting_and_scalar_overloads():
    def f(x, r, c):
        y = x * r + c  # (5, 7) with (1, 7) and (5, 1)
        return torch.ops.aten.add.Scalar(y, 0.25), torch.ops.aten.mul.Scalar(y, 3), y - 1

    check(f, torch.randn(5, 7), torch.randn(1, 7), torch.randn(5, 1))


def test_integer_tensors_with_float_scalars():
    """int64 * 0.5 promotes to the default dtype, as in eager."""
    check(lambda x: (x * 0.5, x + 2), torch.arange(11, dtype=torch.int64).view(1, 11))


@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (1, 1, 1), (0, 4, 3), (6, 0, 2)])
def test_matmul_chain(m, k, n):
    def f(a, w1, w2, bias):
        h = torch.relu(a @ w1)
        return torch.addmm(bias, h, w2), a @ w1.t().t()

    check(f, torch.randn(m, k), torch.randn(k, 9), torch.randn(9, n), torch.randn(n))


def test_batched_matmul_and_matmul_decomposition():
    def f(a, b, w):
        return torch.bmm(a, b), a @ w, torch.matmul(a, b.transpose(1, 2).transpose(1, 2))

    check(f, torch.randn(2, 3, 5), torch.randn(2, 5, 4), torch.randn(5, 6))


def test_matrix_vector():
    check(lambda a, v: torch.mv(a, v) * 2.0, torch.randn(4, 3), torch.randn(3))


@pytest.mark.parametrize("shape", [(4, 6, 5), (1, 1, 1), (3, 0, 2)])
def test_reductions(shape):
    def f(x):
        return (
            x.sum(),
            x.sum(1),
            x.sum((0, 2), keepdim=True),
            x.mean(-1),
            x.mean((0, 1)),
            x.sum(dtype=torch.float64),
        )

    check(f, torch.randn(shape))
    if 0 not in shape:
        check(lambda x: (x.mean(), torch.amax(x, 1)), torch.randn(shape))


def test_views():
    def f(x):
        v = x.view(6, 4)
        t = v.t()
        p = x.permute(2, 0, 1)
        e = x.unsqueeze(0).expand(2, 2, 3, 4)
        s = x.unsqueeze(1).squeeze(1)
        r = x.reshape(4, 6)  # contiguous: a view
        rt = t.reshape(24)  # not viewable: clone + _unsafe_view
        return t * 2, p + 1, e.sum(0), s - 1, r, rt, t.transpose(0, 1), x.transpose(0, 2)

    check(f, torch.randn(2, 3, 4), exact=True)


def test_view_of_a_computed_value_read_twice():
    def f(x, w):
        y = (x + 1.0).view(4, 3)
        return y.t() @ y, y.t() + 0.5, y

    check(f, torch.randn(12), torch.randn(3, 3))


def test_noncontiguous_inputs():
    base = torch.randn(6, 8)
    xt = base.t()  # (8, 6), strides (1, 8)
    xs = base[:, ::2]  # every second column
    xe = torch.randn(1, 8).expand(6, 8)  # stride 0
    check(lambda a, b, c: (a * 2 + 1, (b - 1).sum(0), c + b.sum(1, keepdim=True)), xt, xs, xe)
    check(lambda a, w: a @ w, xt, torch.randn(6, 3))


def test_steps_chain_across_mark_step():
    """A value computed in one step is an input of the next (as with the kiln device)."""
    base = torch.randn(5, 3)
    x = native.tensor(base)
    want = base
    for lr in (0.1, 0.2, 0.3):
        x = x - lr * (x * 2)
        want = want - lr * (want * 2)
        native.mark_step()
        torch.testing.assert_close(native.cpu(x), want)


# ---- structural hash and steady steps ------------------------------------------------------------


def _record(fn, *inputs):
    """Record ``fn`` on native tensors; return (trace hash before the cut, the cut, outputs)."""
    xs = [native.tensor(t) for t in inputs]
    outs = fn(*xs)
    h = native.trace_hash()
    cut = native.mark_step()
    return h, cut, outs


def step(x, w):
    return torch.relu(x @ w + 0.5).sum(0) * 0.1


def test_identical_steps_hash_equal_and_graph_reused(monkeypatch):
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    h1, c1, _ = _record(step, x, w)
    calls = []
    real = native.convert
    monkeypatch.setattr(native, "convert", lambda *a: calls.append(1) or real(*a))
    h2, c2, _ = _record(step, torch.randn(4, 3), w)
    assert h1 == h2 and c1.hash == c2.hash
    assert c2.graph_id == c1.graph_id and not c2.is_new
    assert calls == []  # recognised by the recorder: not converted again


def test_hash_differs_when_an_op_or_shape_changes():
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    h, c, _ = _record(step, x, w)
    other_op, c_op, _ = _record(lambda x, w: torch.sigmoid(x @ w + 0.5).sum(0) * 0.1, x, w)
    other_shape, c_shape, _ = _record(step, torch.randn(6, 3), w)
    other_dim, c_dim, _ = _record(lambda x, w: torch.relu(x @ w + 0.5).sum(1) * 0.1, x, w)
    assert len({h, other_op, other_shape, other_dim}) == 4
    assert len({c.graph_id, c_op.graph_id, c_shape.graph_id, c_dim.graph_id}) == 4
    assert c_op.is_new and c_shape.is_new and c_dim.is_new


def test_lifted_scalars_are_inputs_not_graph():
    """A new learning rate is no new graph: Python floats are scalar inputs (values still right)."""
    x = torch.randn(6)
    _, c1, _ = _record(lambda t: t * 0.5 + 0.125, x)
    got, c2 = run_native(lambda t: t * 0.75 + 3.5, x)
    assert c2.graph_id == c1.graph_id and not c2.is_new
    torch.testing.assert_close(got[0], x * 0.75 + 3.5)
    g = native.graph_of(c2.graph_id)
    assert g.count(lambda n: n.op == "scalar") == 2
    # ints are constants of the node: a new int is a new graph
    _, c3, _ = _record(lambda t: t * 2 + 0.125, x)
    _, c4, _ = _record(lambda t: t * 3 + 0.125, x)
    assert c3.graph_id != c4.graph_id


def test_structural_floats_stay_in_the_node():
    """pow's exponent is kept (as the Python recorder does): another exponent, another graph."""
    x = torch.rand(5) + 0.5
    _, c2, _ = _record(lambda t: t**2.0, x)
    got, c3 = run_native(lambda t: t**3.0, x)
    assert c2.graph_id != c3.graph_id
    torch.testing.assert_close(got[0], x**3.0)


@pytest.mark.parametrize(
    "program",
    [
        lambda x, w: (torch.relu(x @ w + 0.5) * 2.0).sum(0),
        lambda x, w: (x.t().t() @ w).mean(1, keepdim=True) - 0.25,
        lambda x, w: x.view(2, 6).t().sum(1) + w.sum(),
        # the ops the optimizers' foreach ops split into (lifted floats: value=, weight)
        lambda x, w: torch.addcdiv(
            torch.addcmul(x, x, x, value=0.5).lerp(x * 2.0, 0.25),
            x,
            x.abs() + 1.0,
            value=-0.1,
        ).lerp(x, torch.sigmoid(x)),
        # split / chunk pieces: slice links (a transformer's q, k, v)
        lambda x, w: (
            sum(p.sum() * (i + 1) for i, p in enumerate((x @ w).split(2, 1)))
            + torch.cat((x @ w).chunk(3, 1)[::-1], 1).sum(0)
        ),
    ],
    ids=["mlp", "views", "reshape", "optimizer-ops", "split"],
)
def test_same_graph_as_the_python_recorder(program):
    """The converted graph is node for node the Python recorder's graph of the same program
    (equal structural hash, so both share one compile-cache entry)."""
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    _, cut, _ = _record(program, x, w)
    g = native.graph_of(cut.graph_id)
    before = kiln.config.lazy_recorder
    kiln.config.update(lazy_recorder="python")  # (the kiln device's Python recorder)
    try:
        dev = kiln.device()
        out = program(x.to(dev), w.to(dev))
        kiln.mark_step()
        python_graph = trace._last_entry.graph
    finally:
        kiln.config.update(lazy_recorder=before)
    # (compared with that graph itself: native.mark_step compiles its own graph too, so "among
    # the compiled graphs" held for any native graph)
    assert g.hash == python_graph.hash, f"native:\n{g}\nPython recorder:\n{python_graph}"
    torch.testing.assert_close(out.cpu(), program(x, w))


# ---- clean errors ------------------------------------------------------------------------------
# (ops outside the table go to the Python fallback since stage 2: tests/frontends/
# test_native_fallback.py)


def test_reading_a_pending_value_raises():
    base = torch.randn(3)
    x = native.tensor(base)
    with pytest.raises(RuntimeError, match="pending"):
        native.cpu(x + 1.0)
    native.mark_step()
    torch.testing.assert_close(native.cpu(x), base)


def test_kiln_device_unaffected_by_the_native_recorder():
    """With the recorder loaded (its kernels on PrivateUse2), the kiln device (PrivateUse1 and the
    Python key) trains as before: a step with backward and SGD matches eager."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))
    lazy = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))
    lazy.load_state_dict(ref.state_dict())
    dev = kiln.device()
    lazy.to(dev)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, lazy)]
    x, y = torch.randn(7, 6), torch.randn(7, 2)
    for _ in range(2):
        for m, opt, xx, yy in ((ref, opts[0], x, y), (lazy, opts[1], x.to(dev), y.to(dev))):
            loss = torch.nn.functional.mse_loss(m(xx), yy)
            loss.backward()
            opt.step()
            opt.zero_grad()
        kiln.mark_step()
    for p, q in zip(ref.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-5, atol=1e-6)


def test_without_a_compiler_load_raises_a_clear_error(monkeypatch, tmp_path):
    """No working g++: NativeUnavailable naming the reason, remembered (no second build), and
    ``available()`` False; the kiln device's Python recorder is not involved."""
    from kiln.codegen.cpp.build import BuildError
    from kiln.codegen.cpp.extension import Extension

    def no_compiler(*a):
        raise BuildError("no working C++ compiler (g++): not found")

    ext = Extension(
        "kiln_native_recorder",
        native._EXT.source,
        ["-O2", "-w"],
        "recorder",
        headers=native._EXT.headers,
    )
    monkeypatch.setattr(ext, "build", no_compiler)
    monkeypatch.setattr(kiln.config, "launcher_dir", str(tmp_path))
    monkeypatch.setattr(native, "_EXT", ext)
    monkeypatch.setattr(native, "_configured", [])
    with pytest.raises(native.NativeUnavailable, match=r"no working C\+\+ compiler"):
        native.load()
    monkeypatch.setattr(ext, "build", lambda *a: pytest.fail("built twice"))
    with pytest.raises(native.NativeUnavailable, match=r"no working C\+\+ compiler"):
        native.load()
    assert not native.available()


def test_every_recorder_file_is_built_and_keyed(monkeypatch, tmp_path):
    """The recorder's source includes each listed header (all of them exist), and the build's
    cache key covers each: editing any one of them gives a new extension name (a rebuild), and
    the build is handed every header beside the source."""
    from kiln.codegen.cpp.extension import Extension

    source = native._EXT.source.read_text()
    here = native._EXT.source.parent
    assert sorted(p.name for p in here.glob("*.h")) == sorted(native.HEADERS)
    assert all((here.parent / h).is_file() for h in native.SHARED_HEADERS)
    every = (*native.HEADERS, *native.SHARED_HEADERS)
    for h in every:
        assert f'#include "{h}"' in source

    copies = []
    for p in [native._EXT.source, *native._EXT.headers]:
        (tmp_path / p.name).write_text(p.read_text())
        copies.append(tmp_path / p.name)
    ext = Extension("kiln_rec_key", copies[0], ["-O2"], "recorder", headers=tuple(copies[1:]))
    built: list[str] = []

    def fake_build(name, src, so):
        built.append(name)
        raise OSError("not built in this test")

    monkeypatch.setattr(kiln.config, "launcher_dir", str(tmp_path / "cache"))
    monkeypatch.setattr(ext, "build", fake_build)
    for path in copies:
        ext.forget()
        path.write_text(path.read_text() + "\n// edited\n")
        with pytest.raises(OSError):
            ext.load()
    assert len(built) == len(copies) == len(set(built)) == 1 + len(every)
    assert set(ext.header_texts()) == set(every)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
def test_other_dtypes(dtype):
    """Geometry includes the dtype: each dtype its own recipe, results as eager's (bf16 rounded
    per op, int32 promoted by a float scalar)."""

    def f(x, y):
        return (x * y + x) - 3, (x + 0.5).sum(0), x @ y.t()

    x = (torch.randn(4, 5) * 4).to(dtype)
    y = (torch.randn(4, 5) * 4).to(dtype)
    check(f, x, y)


def test_reshape_and_as_strided_of_computed_permuted_values_match_eager():
    """A computed value whose geometry is permuted (``x.t() * 2``): ``reshape`` (PyTorch's
    ``_reshape_alias`` with strides from that geometry) is recorded as ``view``, and the step's
    result is laid out in the geometry, so strided reads of it see eager's elements."""
    x = torch.randn(3, 5)
    check(lambda t: (t.t() * 2).reshape(5, 3), x)
    check(lambda t: (t.t() * 2).reshape(5, 3, 1), x)
    check(lambda t: (t.permute(1, 0) + 1).reshape(-1), x)
    got, _ = run_native(lambda t: t.t() * 2, x)
    assert got[0].stride() == (x.t() * 2).stride()
    check(lambda t: (t.t() * 2).as_strided((5, 3), (1, 5)), x)
    q = torch.randn(2, 3, 5)
    check(lambda t: torch.nn.functional.scaled_dot_product_attention(t, t * 0.5, t), q)


def test_aliasing_as_pytorch_sees_it():
    """``is_alias_of`` (what DistributedDataParallel's reducer asks of a gradient and its bucket
    view) says what shares a storage: a tensor and its views do, two tensors -- even of equal
    values, or a copy -- do not."""
    alias = torch._C._is_alias_of  # Tensor::is_alias_of, as C++ callers see it
    x = native.tensor(torch.arange(12.0))
    v = x.view(3, 4)[1:]
    y = native.tensor(torch.arange(12.0))
    c = x.clone()
    z = x * 1
    assert alias(x, v) and alias(v, x) and alias(x[2:], v.t())
    assert not alias(x, y) and not alias(x, c) and not alias(x, z)
    x.mul_(2)  # an in-place update keeps the alias (the storage is the same)
    assert alias(x, v)
    native.mark_step()
    assert alias(x, v) and not alias(x, z)
    torch.testing.assert_close(native.cpu(v), torch.arange(12.0).view(3, 4)[1:] * 2)
