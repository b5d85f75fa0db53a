"""Ops that libraries call with a dtype only an accelerator's kernel takes, on the kiln device.

transformers' mixture-of-experts layers count tokens per expert with ``torch.histc`` of int32
expert ids whenever the device is not the CPU (CUDA's kernel takes integers, the CPU's does not);
the kiln device ran the CPU kernel and raised ``"histogram_cpu" not implemented for 'Int'``.
``lazy/accelerator_dtypes.py`` computes it in float64 and returns the input's dtype; here against
the counts eager computes for the same values (as float, the CPU path), and Mixtral trained on the
device (its default experts path) against eager."""

from __future__ import annotations

import copy

import pytest
import torch

import kiln

DEV = kiln.device()


def _histc(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    out = torch.histc(x.to(DEV), bins=bins, min=lo, max=hi)
    kiln.mark_step()
    return out.cpu()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
@pytest.mark.parametrize(
    ("values", "bins", "lo", "hi"),
    [
        (list(range(8)) * 3 + [3, 3, 5], 8, 0, 7),  # expert ids, one bin each
        ([0, 1, 2, 9, 10, 11, 12, 20], 4, 2, 11),  # values outside [min, max] dropped
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], 3, 0, 8),  # several values a bin, max in the last bin
        ([4, 7, 7, 1, 9], 5, 0, 0),  # min = max = 0: the data's own range
    ],
)
def test_integer_histc_counts_as_eager(dtype, values, bins, lo, hi):
    x = torch.tensor(values, dtype=dtype)
    want = torch.histc(x.float(), bins=bins, min=lo, max=hi).to(dtype)
    got = _histc(x, bins, lo, hi)
    assert got.dtype == dtype
    assert torch.equal(got, want), (got, want)


def test_integer_histc_on_a_non_contiguous_and_an_empty_input():
    x = torch.arange(24, dtype=torch.int32).reshape(4, 6).t()  # transposed view
    want = torch.histc(x.float(), bins=6, min=0, max=23).to(torch.int32)
    assert torch.equal(_histc(x, 6, 0, 23), want)
    empty = torch.zeros(0, dtype=torch.int32)
    assert torch.equal(_histc(empty, 4, 0, 3), torch.zeros(4, dtype=torch.int32))


def test_float_histc_is_recorded_as_it_is():
    x = torch.tensor([0.1, 0.5, 0.5, 0.9, 1.5])
    torch.testing.assert_close(_histc(x, 4, 0.0, 1.0), torch.histc(x, bins=4, min=0.0, max=1.0))


transformers = pytest.importorskip("transformers")


def _train(model, batches, dev):
    model = model.to(dev)
    # SGD: the update is the gradient itself (Adam turns the float noise of gradients that are
    # ~0 into full-size updates, in any mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for ids in batches:
        ids = ids.to(dev)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        if dev.type == "kiln":
            kiln.mark_step()
        out.append((loss.item(), grads))
    return out, [p.detach().cpu() for p in model.parameters()]


def test_mixture_of_experts_model_trains_as_in_eager():
    cfg = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM._from_config(cfg).train()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 8), generator=g) for _ in range(2)]
    want, want_params = _train(copy.deepcopy(base), batches, torch.device("cpu"))
    got, got_params = _train(copy.deepcopy(base), batches, DEV)
    for (gl, gg), (wl, wg) in zip(got, want):
        assert abs(gl - wl) <= 1e-5 * abs(wl), (gl, wl)
        for a, b in zip(gg, wg):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(got_params, want_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
