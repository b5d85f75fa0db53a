"""fp8 linear layer: SQNR of output and gradients, rowwise vs tensorwise, short MLP training."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kiln.precision import Fp8Linear, convert_to_fp8


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return 20 * math.log10(ref.norm().item() / (ref - got).norm().item())


def _grads(layer: nn.Module, x: torch.Tensor, go: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(go)
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_linear_sqnr(scaling):
    torch.manual_seed(0)
    ref = nn.Linear(256, 128)
    f8 = Fp8Linear.from_linear(nn.Linear(256, 128), scaling)
    f8.load_state_dict(ref.state_dict())
    x, go = torch.randn(512, 256), torch.randn(512, 128)
    r, g = _grads(ref, x, go), _grads(f8, x, go)
    for a, b in zip(r[:3], g[:3]):  # output, input gradient, weight gradient
        assert sqnr(a, b) > 20.0, (scaling, sqnr(a, b))
    assert torch.allclose(r[3], g[3], rtol=1e-5, atol=1e-4)  # the bias gradient is not quantized


def test_rowwise_beats_tensorwise_with_an_outlier():
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.05
    x = torch.randn(512, 256)
    x[3, 7] = 1e5  # one outlier: a single tensor-wide scale crushes every other row
    ref = x @ w.t()
    out = {}
    for s in ("tensorwise", "rowwise"):
        lay = Fp8Linear(256, 128, bias=False, scaling=s)
        lay.weight.data.copy_(w)
        out[s] = lay(x).detach()
    keep = torch.ones(512, dtype=torch.bool)
    keep[3] = False
    rw, tw = sqnr(ref[keep], out["rowwise"][keep]), sqnr(ref[keep], out["tensorwise"][keep])
    assert rw > 20.0 and rw > tw + 5.0, (rw, tw)


def test_convert_and_shapes():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 4)))
    params = list(m.parameters())
    convert_to_fp8(m, "rowwise")
    assert isinstance(m[0], Fp8Linear) and isinstance(m[2][0], Fp8Linear)
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    y = m(torch.randn(2, 3, 8))
    assert y.shape == (2, 3, 4)
    y.sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in m.parameters())
    assert m(torch.randn(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="scaling"):
        Fp8Linear(4, 4, scaling="blockwise")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gpt2s_conv1d_layers_are_converted(scaling):
    """GPT-2's attention and MLP projections are ``transformers``' ``Conv1D`` (weight stored as
    ``(in, out)``), not ``nn.Linear``: they were left in fp32 without a word, and only the tied
    ``lm_head`` was converted.  Now every one runs in fp8 as the same layer's transposed
    ``Fp8Linear`` would, on the same parameters, with ``lm_head`` still tied."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    from kiln.precision import Fp8Conv1D, fp8_linear

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    convs = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(convs) == 8
    params = [id(p) for p in model.parameters()]
    convert_to_fp8(model, scaling)
    mods = dict(model.named_modules())
    assert all(isinstance(mods[n], Fp8Conv1D) for n in convs)
    assert isinstance(model.lm_head, Fp8Linear)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [id(p) for p in model.parameters()] == params
    layer = mods["transformer.h.0.mlp.c_fc"]
    x = torch.randn(3, 5, 32)
    want = fp8_linear(x, layer.weight.t().contiguous(), layer.bias, scaling)
    assert torch.equal(layer(x), want)
    ref = x @ layer.weight + layer.bias
    assert sqnr(ref, layer(x)) > 20.0
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_a_model_with_nothing_to_convert_is_an_error():
    with pytest.raises(ValueError, match="no nn.Linear or transformers Conv1D"):
        convert_to_fp8(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
