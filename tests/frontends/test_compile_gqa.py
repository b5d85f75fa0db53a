"""Repeated k/v heads before SDPA -> grouped-query SDPA (kiln/frontends/compile/gqa.py): which
graphs are rewritten, and that forward, gradients and an optimizer step through
``backend="kiln"`` equal eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontends.compile import attention
from kiln.frontends.compile.attention import attention_to_sdpa


@pytest.fixture(autouse=True)
def any_key_length(monkeypatch):
    """Hand-written attention at these small sizes is rewritten to SDPA too (the rewrite's
    key-length rule is tested in test_compile_attention_rewrite.py)."""
    monkeypatch.setattr(attention, "MIN_KEYS", 1)


from kiln.frontends.compile.gqa import sdpa_gqa


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' repeat_kv: each head n times in a row."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def repeat_kv_unsqueeze(x: torch.Tensor, n: int) -> torch.Tensor:
    b, kv, s, d = x.shape
    return torch.reshape(x.unsqueeze(2).expand(b, kv, n, s, d), (b, kv * n, s, d))


def tile_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """Heads repeated as a whole block (h -> h % kv): not the grouped-query pairing."""
    b, kv, s, d = x.shape
    return x[:, None].expand(b, n, kv, s, d).reshape(b, n * kv, s, d)


def sdpa_rep(q, k, v, n, rep=repeat_kv, **kw):
    return F.scaled_dot_product_attention(q, rep(k, n), rep(v, n), **kw)


def hand_rep(q, k, v, n, bias=None):
    """transformers' eager attention: repeat, matmul, add the mask (if any), softmax, matmul."""
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    a = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    if bias is not None:
        a = a + bias
    return torch.matmul(F.softmax(a, dim=-1, dtype=torch.float32), v)


def _capture(fn, *args):
    """(rewrites, SDPA calls' kwargs, ops) of ``fn``'s Dynamo graph after both rewrites."""
    seen: dict = {}

    def backend(gm, example_inputs):
        attention_to_sdpa(gm)
        before = set(gm.graph.nodes)
        seen["n"] = sdpa_gqa(gm)
        assert set(gm.graph.nodes) <= before  # only rewires and erases
        calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        seen["ops"] = [getattr(n.target, "__name__", str(n.target)) for n in calls]
        seen["sdpa"] = [
            dict(n.kwargs) for n in calls if "scaled_dot" in getattr(n.target, "__name__", "")
        ]
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return seen


def _qkv(b=2, h=4, kv=2, l=7, s=5, e=3, ev=6):
    def t(n, heads, d):
        return torch.randn(b, n, heads, d).transpose(1, 2)  # (B, N, H, D) transposed: strided

    return t(l, h, e), t(s, kv, e), t(s, kv, ev)


@pytest.mark.parametrize("rep", [repeat_kv, repeat_kv_unsqueeze])
def test_golden_repeat_becomes_enable_gqa(rep):
    q, k, v = _qkv()
    seen = _capture(lambda q, k, v: sdpa_rep(q, k, v, 2, rep=rep), q, k, v)
    assert seen["n"] == 1
    assert [kw.get("enable_gqa") for kw in seen["sdpa"]] == [True]
    assert not {"expand", "reshape", "view"} & set(seen["ops"]), seen["ops"]


def test_golden_hand_written_attention_with_repeat():
    q, k, v = _qkv()
    seen = _capture(lambda q, k, v: hand_rep(q, k, v, 2), q, k, v)
    assert seen["n"] == 1
    assert [kw.get("enable_gqa") for kw in seen["sdpa"]] == [True]


def test_golden_hand_written_attention_with_a_float_bias_is_kept():
    """With transformers' additive mask the chain is kept as written (attention.py: a whole row
    of ``finfo.min``), so there is no SDPA call for this pass to take."""
    q, k, v = _qkv()
    bias = torch.where(torch.rand(7, 5) > 0.3, 0.0, torch.finfo(torch.float32).min)
    seen = _capture(lambda q, k, v: hand_rep(q, k, v, 2, bias), q, k, v)
    assert seen["n"] == 0 and seen["sdpa"] == []


def _twice(q, k, v):
    # k repeated 4x from 1 head, v 2x from 2 heads: both 4 heads, not one grouping
    return F.scaled_dot_product_attention(q, repeat_kv(k[:, :1], 4), repeat_kv(v, 2))


def _also_read(q, k, v):
    kr = repeat_kv(k, 2)
    return F.scaled_dot_product_attention(q, kr, repeat_kv(v, 2)) + kr.sum()


@pytest.mark.parametrize(
    ("why", "fn", "rewrites"),
    [
        ("tiled, not grouped", lambda q, k, v: sdpa_rep(q, k, v, 2, rep=tile_kv), 0),
        ("k and v grouped differently", _twice, 0),
        ("repeated k also read elsewhere: rewritten, the repeat kept", _also_read, 1),
    ],
)
def test_which_are_rewritten(why, fn, rewrites):
    seen = _capture(fn, *_qkv())
    assert seen["n"] == rewrites, why
    if rewrites:
        assert "expand" in seen["ops"]  # the other reader still gets the repeated k


def _grads(fn, xs, cot):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs, cot)


_GEN = torch.Generator().manual_seed(1)
_FLOAT_MASK = torch.randn(2, 1, 7, 5, generator=_GEN)
_BOOL_MASK = torch.rand(7, 9, generator=_GEN) > 0.3
_BOOL_MASK[:, 0] = True  # no row without a key

CASES = {
    # name: (fn(q, k, v), q/k/v builder)
    "float_mask": (
        lambda q, k, v: sdpa_rep(q, k, v, 2, attn_mask=_FLOAT_MASK),
        lambda: _qkv(),
    ),
    "bool_mask_odd_sizes_3_groups": (
        lambda q, k, v: sdpa_rep(q, k, v, 3, attn_mask=_BOOL_MASK),
        lambda: _qkv(b=3, h=6, kv=2, l=7, s=9, e=5, ev=3),
    ),
    "causal_one_kv_head": (
        lambda q, k, v: sdpa_rep(q, k, v, 4, is_causal=True, scale=0.3),
        lambda: _qkv(b=1, h=4, kv=1, l=6, s=6, e=4, ev=4),
    ),
    "one_group_each": (lambda q, k, v: sdpa_rep(q, k, v, 1), lambda: _qkv(h=2, kv=2)),
    "hand_written": (lambda q, k, v: hand_rep(q, k, v, 2), lambda: _qkv(l=7, s=5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_eager_forward_and_gradients(name):
    torch.manual_seed(0)
    fn, make = CASES[name]
    xs = list(make())
    torch._dynamo.reset()
    before = kiln.metrics.get("sdpa_gqa")
    cot = torch.randn(fn(*xs).shape)
    eo, eg = _grads(fn, xs, cot)
    ko, kg = _grads(torch.compile(fn, backend="kiln"), xs, cot)
    assert kiln.metrics.get("sdpa_gqa") == before + 1
    torch.testing.assert_close(ko, eo, rtol=1e-5, atol=1e-6)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_zero_size_batch_is_left_as_written():
    q, k, v = _qkv(b=0)
    torch._dynamo.reset()
    before = kiln.metrics.get("sdpa_gqa")
    out = torch.compile(lambda q, k, v: sdpa_rep(q, k, v, 2), backend="kiln")(q, k, v)
    assert out.shape == (0, 4, 7, 6)
    assert kiln.metrics.get("sdpa_gqa") == before


def test_switched_off():
    q, k, v = _qkv()
    kiln.config.update(disable_passes="gqa")
    try:
        torch._dynamo.reset()
        before = kiln.metrics.get("sdpa_gqa")
        out = torch.compile(lambda q, k, v: sdpa_rep(q, k, v, 2), backend="kiln")(q, k, v)
        assert kiln.metrics.get("sdpa_gqa") == before
    finally:
        kiln.config.update(disable_passes="")
    torch.testing.assert_close(out, sdpa_rep(q, k, v, 2))


def test_hf_llama_eager_attention_training_step_matches_eager():
    """transformers' Llama (4 query heads, 2 k/v heads, eager attention: repeat_kv and an
    additive mask): loss, gradients and SGD's updated parameters of a compiled step equal
    eager's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=50, num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 50, (3, 11))

    def make():
        m = copy.deepcopy(model)
        # SGD: the update is linear in the gradient (AdamW turns rounding noise of a ~0
        # gradient into a full step of lr, both in eager and here)
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def step(m, opt):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.detach().clone() for p in m.parameters()]
        opt.step()
        opt.zero_grad()
        return loss.detach(), grads

    def close(a, b):  # tests/conformance/_training.py's measure: relative to the tensor's scale
        a, b = a.detach(), b.detach()
        assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max()) + 1e-7

    (em, eopt), (km, kopt) = make(), make()
    torch._dynamo.reset()
    before = kiln.metrics.get("sdpa_gqa")
    compiled = torch.compile(step, backend="kiln")
    for _ in range(2):
        el, eg = step(em, eopt)
        kl, kg = compiled(km, kopt)
        torch.testing.assert_close(kl, el, rtol=1e-5, atol=1e-6)
        for a, b in zip(kg, eg):
            close(a, b)
        for a, b in zip(km.parameters(), em.parameters()):
            close(a, b)
    # its additive mask keeps the chain as written (attention.py), so no SDPA call to take
    assert kiln.metrics.get("sdpa_gqa") == before
