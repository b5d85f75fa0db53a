"""SDPA over short keys -> the attention chain (kiln/frontends/compile/short_attention.py): which
calls are rewritten, and that forward and gradients through ``backend="kiln"`` equal eager SDPA
over causal, bool and float masks (whole rows masked included), grouped-query heads, strided
inputs, odd and dynamic sizes; a training step equal to eager in loss, gradients and parameters."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import metrics
from kiln.frontends.compile import attention
from kiln.frontends.compile.short_attention import sdpa_to_chain
from tests.frontends._dynamo_rewrites import rewritten

CHAIN = "attention_chain.default"


def _strided(b, h, s, e, gen):
    """(B, H, S, E) as a transpose of (B, S, H, E), as models make q/k/v: not contiguous."""
    return torch.randn(b, s, h, e, generator=gen).transpose(1, 2)


def _qkv(b=2, h=4, kv=4, l=7, s=9, e=8, ev=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = _strided(b, h, l, e, gen)
    k = _strided(b, kv, s, e, gen)
    v = _strided(b, kv, s, ev or e, gen)
    return q, k, v


def _grads(fn, q, k, v, **kw):
    """fn's output and q/k/v gradients against a fixed random cotangent."""
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    y = fn(*ins, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * dy).sum().backward()
    return [y.detach()] + [t.grad for t in ins]


def _sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _assert_eager(q, k, v, rewrites=1, atol=2e-6, **kw):
    """Compiled (kiln) vs eager SDPA: output and every gradient; the rewrite counted."""
    torch._dynamo.reset()
    before = metrics.counters().get("sdpa_to_chain", 0)
    want = _grads(_sdpa, q, k, v, **kw)
    got = _grads(torch.compile(_sdpa, backend="kiln"), q, k, v, **kw)
    assert metrics.counters().get("sdpa_to_chain", 0) - before == rewrites
    for w, g in zip(want, got):
        assert w.shape == g.shape
        assert not g.isnan().any()
        torch.testing.assert_close(g, w, atol=atol, rtol=1e-5)


def _dead_bool(shape, dead_rows, seed=1):
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    m[..., 0] |= True  # most rows keep a key ...
    for idx in dead_rows:
        m[idx] = False  # ... these keep none: SDPA gives 0 and zero gradients
    return m


# ---- which calls are taken -------------------------------------------------------------------


def test_call_becomes_chain():
    q, k, v = _qkv()
    seen = rewritten(sdpa_to_chain, lambda q, k, v: _sdpa(q, k, v, is_causal=True), q, k, v)
    assert seen["n"] == 1 and seen["meta"]
    assert CHAIN in seen["ops"] and "scaled_dot_product_attention" not in seen["ops"]


@pytest.mark.parametrize(
    "case",
    ["dropout", "long keys", "bfloat16", "mask requires grad", "zero-size", "rank 3", "autocast"],
)
def test_kept_as_sdpa(case, monkeypatch):
    q, k, v = _qkv()
    kw: dict = {}
    if case == "dropout":
        kw = {"dropout_p": 0.5}
    elif case == "long keys":
        monkeypatch.setattr(attention, "MIN_KEYS", 9)  # k has 9 keys
    elif case == "bfloat16":
        q, k, v = (t.bfloat16() for t in (q, k, v))
    elif case == "mask requires grad":
        kw = {"attn_mask": torch.zeros(7, 9, requires_grad=True)}
    elif case == "zero-size":
        q, k, v = _qkv(b=0)
    elif case == "rank 3":
        q, k, v = (t[0] for t in (q, k, v))

    def fn(q, k, v):
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return _sdpa(q, k, v)
        return _sdpa(q, k, v, **kw)

    seen = rewritten(sdpa_to_chain, fn, q, k, v)
    assert seen["n"] == 0 and CHAIN not in seen["ops"]


# ---- equal to eager SDPA ---------------------------------------------------------------------


@pytest.mark.parametrize(("l", "s"), [(7, 9), (9, 7), (1, 1), (1, 13), (13, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_and_causal(l, s, causal):
    """Causal aligned top left (query i sees keys 0..i), also for L != S."""
    _assert_eager(*_qkv(l=l, s=s, ev=5), is_causal=causal)


def test_scale_given():
    _assert_eager(*_qkv(), scale=0.3)


@pytest.mark.parametrize("shape", [(7, 9), (2, 1, 7, 9), (2, 4, 7, 9), (1, 1, 1, 9), (2, 1, 1, 9)])
def test_bool_mask_with_whole_rows_masked(shape):
    dead = [(0,) * (len(shape) - 1)] if shape[-2] > 1 else []
    if len(shape) == 4 and shape[-2] > 1:
        dead.append((shape[0] - 1, shape[1] - 1, 3))
    _assert_eager(*_qkv(), attn_mask=_dead_bool(shape, dead))


def test_float_mask_with_inf_rows_stays_sdpa():
    m = torch.randn(2, 1, 7, 9)
    m[0, 0, 3] = -math.inf  # a whole row
    m[1, 0, 2, :4] = -math.inf  # part of one
    before = metrics.counters().get("sdpa_kept:float mask", 0)
    _assert_eager(*_qkv(), rewrites=0, attn_mask=m)
    assert metrics.counters().get("sdpa_kept:float mask", 0) - before == 1


def test_transformers_style_finite_mask_stays_sdpa():
    """``where(keep, 0, finfo.min)`` with a row that keeps nothing: every score of that row rounds
    to ``min``.  ATen's CPU flash backward gives such a row other gradients than the chain's
    softmax (it recomputes p = exp(s - lse) with lse rounded to ``min``: 1 instead of 1/S), and
    the model called SDPA: the call stays SDPA and the compiled step has eager's numbers."""
    keep = _dead_bool((2, 1, 7, 9), [(0, 0, 4)])

    def fn(q, k, v):
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
        return _sdpa(q, k, v, attn_mask=mask)

    seen = rewritten(sdpa_to_chain, fn, *_qkv())
    assert seen["n"] == 0
    m = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    q, k, v = _qkv()
    chain = _grads(
        lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5 + m, -1) @ v,
        q,
        k,
        v,
    )
    flash = _grads(_sdpa, q, k, v, attn_mask=m)
    # (the case is one where the two differ: the chain would not give eager's gradients)
    assert max(float((a - b).abs().max()) for a, b in zip(chain[1:], flash[1:])) > 1e-2
    _assert_eager(q, k, v, rewrites=0, attn_mask=m)


@pytest.mark.parametrize(
    "mask",
    [None, "causal", (2, 6, 7, 9), (7, 9), (2, 1, 1, 9), (2, 6, 1, 9), "float"],
)
def test_grouped_query(mask):
    """enable_gqa: query head h reads k/v head h // 3 (6 query heads, 2 k/v heads)."""
    q, k, v = _qkv(h=6, kv=2, ev=5)
    kw: dict = {"enable_gqa": True}
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "float":  # stays SDPA (test_float_mask_with_inf_rows_stays_sdpa)
        m = torch.randn(2, 1, 7, 9)
        m[1, 0, 5] = -math.inf
        kw["attn_mask"] = m
    elif mask is not None:
        dead = [(0,) * (len(mask) - 1)]
        kw["attn_mask"] = _dead_bool(mask, dead)
    _assert_eager(q, k, v, rewrites=0 if mask == "float" else 1, **kw)


@pytest.mark.parametrize(
    ("b", "h", "kv", "t", "e"),
    [(4, 4, 4, 64, 32), (4, 4, 2, 64, 32), (8, 4, 2, 128, 64), (8, 4, 4, 255, 64)],
    ids=["gpt2-small", "llama-small", "llama-large", "just-below-min-keys"],
)
def test_benchmark_sizes_with_a_transformers_causal_mask(b, h, kv, t, e):
    """The benchmark's sizes, with the causal mask as transformers builds it for SDPA (a bool
    (B, 1, T, T) expand of an arange comparison), a left-padded first sample (its padding rows
    attend to nothing), grouped-query where k/v have fewer heads."""
    q, k, v = _qkv(b=b, h=h, kv=kv, l=t, s=t, e=e)
    pos = torch.arange(t)
    keep = (pos[None, :] <= pos[:, None]).expand(b, 1, t, t).clone()
    keep[0, :, :, :5] = False  # sample 0: five padding tokens on the left
    _assert_eager(q, k, v, atol=1e-5, attn_mask=keep, enable_gqa=kv != h)


def test_zero_size_batch_compiles_and_equals_eager():
    """Kept as SDPA (nothing to gain): the compiled step still equals eager, empty gradients."""
    _assert_eager(*_qkv(b=0), rewrites=0, is_causal=True)


def test_chain_that_cannot_be_built_stays_sdpa(monkeypatch):
    """An error while making the chain's metadata keeps the call as SDPA, counted as a fallback."""
    from kiln.frontends.compile import short_attention

    def broken(*args):
        raise RuntimeError("no chain here")

    monkeypatch.setattr(short_attention, "_CHAIN", broken)
    before = metrics.counters()["fallbacks"].get("sdpa_to_chain (RuntimeError: no chain here)", 0)
    seen = rewritten(sdpa_to_chain, lambda q, k, v: _sdpa(q, k, v, is_causal=True), *_qkv())
    assert seen["n"] == 0 and "scaled_dot_product_attention" in seen["ops"]
    after = metrics.counters()["fallbacks"].get("sdpa_to_chain (RuntimeError: no chain here)", 0)
    assert after == before + 1


def test_grouped_query_after_repeat_kv():
    """transformers' repeat_kv before SDPA: the gqa rewrite makes it enable_gqa first, then this
    one takes it (through the whole backend)."""
    q, k, v = _qkv(h=4, kv=2)

    def fn(q, k, v):
        b, kv, s, e = k.shape
        rk = k[:, :, None].expand(b, kv, 2, s, e).reshape(b, kv * 2, s, e)
        rv = v[:, :, None].expand(b, kv, 2, s, e).reshape(b, kv * 2, s, e)
        return _sdpa(q, rk, rv, is_causal=True)

    before = dict(metrics.counters())
    torch._dynamo.reset()
    want = _grads(fn, q, k, v)
    got = _grads(torch.compile(fn, backend="kiln"), q, k, v)
    after = metrics.counters()
    assert after.get("sdpa_gqa", 0) - before.get("sdpa_gqa", 0) == 1
    assert after.get("sdpa_to_chain", 0) - before.get("sdpa_to_chain", 0) == 1
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


def test_dynamic_lengths():
    """One graph for several sequence lengths (symbolic sizes through the op's decomposition)."""
    torch._dynamo.reset()
    cf = torch.compile(lambda q, k, v: _sdpa(q, k, v, is_causal=True), backend="kiln", dynamic=True)
    for t in (5, 11, 16):
        q, k, v = _qkv(l=t, s=t, seed=t)
        want = _grads(_sdpa, q, k, v, is_causal=True)
        got = _grads(cf, q, k, v)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


def test_inference_graph():
    """Under no_grad the direct inference path records through the op too."""
    q, k, v = _qkv(h=6, kv=2)
    torch._dynamo.reset()
    before = dict(metrics.counters())
    with torch.no_grad():
        want = _sdpa(q, k, v, is_causal=True, enable_gqa=True)
        got = torch.compile(
            lambda q, k, v: _sdpa(q, k, v, is_causal=True, enable_gqa=True), backend="kiln"
        )(q, k, v)
    after = metrics.counters()
    assert after.get("inference_graphs", 0) - before.get("inference_graphs", 0) == 1
    assert after.get("sdpa_to_chain", 0) - before.get("sdpa_to_chain", 0) == 1
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_disabled_by_config(monkeypatch):
    from kiln.config import config

    monkeypatch.setattr(config, "disable_passes", "short_attention")
    before = metrics.counters().get("sdpa_to_chain", 0)
    q, k, v = _qkv()
    torch._dynamo.reset()
    torch.compile(_sdpa, backend="kiln")(q, k, v)
    assert metrics.counters().get("sdpa_to_chain", 0) == before


# ---- a training step -------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, d=32, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.kv, self.e = heads, kv_heads, d // heads
        self.qkv = torch.nn.Linear(d, (heads + 2 * kv_heads) * self.e)
        self.out = torch.nn.Linear(d, d)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.e, self.kv * self.e, self.kv * self.e], -1)
        q = q.view(b, t, self.h, self.e).transpose(1, 2)
        k = k.view(b, t, self.kv, self.e).transpose(1, 2)
        v = v.view(b, t, self.kv, self.e).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("padded", [False, True])
def test_training_step_equals_eager(padded):
    """Forward, backward and SGD-with-momentum update compiled as one step: loss, every gradient
    and every parameter equal to eager's over three steps (a padding mask masks whole rows)."""
    torch.manual_seed(0)
    model = _Block()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 12, 32)
    mask = None
    if padded:
        keep = torch.ones(3, 1, 12, 12, dtype=torch.bool).tril()
        keep[1, :, :, :4] = False  # left padding: the first rows of sample 1 attend to nothing
        mask = keep

    def make_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x):
            opt.zero_grad()
            loss = m(x, mask).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        return step

    torch._dynamo.reset()
    before = metrics.counters().get("sdpa_to_chain", 0)
    eager, compiled = make_step(ref), kiln.compile(make_step(model))
    for _ in range(3):
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-6, rtol=1e-5)
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5, msg=name)
    assert metrics.counters().get("sdpa_to_chain", 0) > before
