"""fp8 layers through Kiln's two modes: the whole step compiled and the lazy device.

``Fp8Linear``'s quantizers are generated kernels called through raw pointers; Dynamo once died
tracing into them (an internal RecursionError) and the lazy device refused kiln tensors.  They
are now one custom op (``kiln::fp8_fake_quant``) that both modes take whole and run on the CPU
buffers, counted as a fallback.  Quantization turns an ulp of its input into a code step, so the
modes are compared where their inputs to the quantizers are eager's bits: one layer's forward
and gradients, and an MLP with ReLU (exact in every mode) trained with SGD.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_cases import mse_step
from torch import nn

import kiln
from kiln import metrics
from kiln.precision import Fp8Linear, convert_to_fp8

DEV = kiln.device()


def _layer_run(layer: nn.Module, x: torch.Tensor, go: torch.Tensor, mode: str) -> list:
    dev = DEV if mode == "lazy" else torch.device("cpu")
    layer = copy.deepcopy(layer).to(dev)
    x = x.detach().clone().to(dev).requires_grad_(True)

    def fwd_bwd(x: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        out.backward(go)
        return out

    f = torch.compile(fwd_bwd, backend="kiln") if mode == "compile" else fwd_bwd
    out = f(x, go.to(dev))
    if mode == "lazy":
        kiln.mark_step()
    return [t.detach().cpu() for t in (out, x.grad, layer.weight.grad, layer.bias.grad)]


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", ["compile", "lazy"])
def test_one_fp8_layer_matches_eager_forward_and_gradients(mode, scaling, contiguous):
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = Fp8Linear(48, 24, scaling=scaling)
    x, go = torch.randn(3, 5, 48) * 4, torch.randn(3, 5, 24)
    if not contiguous:
        x = (torch.randn(5, 3, 48) * 4).transpose(0, 1)
    want = _layer_run(layer, x, go, "eager")
    before = metrics.counters()["fallbacks"].get("fp8_fake_quant", 0)
    got = _layer_run(layer, x, go, mode)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    # the quantizers ran as the custom op (four a step: input, weight, two of the gradient)
    assert metrics.counters()["fallbacks"].get("fp8_fake_quant", 0) > before


def test_zero_size_batches_pass_through_both_modes():
    torch.manual_seed(0)
    layer = Fp8Linear(8, 4)
    x, go = torch.randn(0, 8), torch.randn(0, 4)
    want = _layer_run(layer, x, go, "eager")
    for mode in ("compile", "lazy"):
        torch._dynamo.reset()
        for a, b in zip(_layer_run(layer, x, go, mode), want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_an_fp8_mlp_trains_as_in_eager_in_both_modes(scaling):
    torch.manual_seed(0)
    base = convert_to_fp8(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)),
        scaling,
    )
    data = [(torch.randn(32, 16), torch.randn(32, 4)) for _ in range(3)]
    runs = {}
    for mode in ("eager", "compile", "lazy"):
        torch._dynamo.reset()
        dev = DEV if mode == "lazy" else torch.device("cpu")
        model = copy.deepcopy(base).to(dev)
        step = mse_step(model, torch.optim.SGD(model.parameters(), lr=0.05))
        f = torch.compile(step, backend="kiln") if mode == "compile" else step
        losses = []
        syncs = metrics.get("forced_syncs")
        for x, y in data:
            loss = f(x.to(dev), y.to(dev))
            if mode == "lazy":
                kiln.mark_step()
            losses.append(loss.item())
        if mode == "lazy":  # the op is recorded into the step's graph, not run by a sync
            assert metrics.get("forced_syncs") == syncs
        runs[mode] = (torch.tensor(losses), [p.detach().cpu() for p in model.parameters()])
    for mode in ("compile", "lazy"):
        torch.testing.assert_close(runs[mode][0], runs["eager"][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(runs[mode][1], runs["eager"][1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_tensor_on_another_device_is_refused_naming_both_devices():
    layer = Fp8Linear(8, 4)
    with pytest.raises(ValueError) as e:
        layer(torch.randn(2, 8, device="meta"))
    assert str(e.value) == (
        "fp8_linear runs on CPU and kiln tensors (Kiln's fp8 kernels are CPU kernels), got "
        "meta and cpu"
    )
