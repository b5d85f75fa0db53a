"""Scaled dot-product attention on the kiln device: forward, gradients, and which kernel ran.

The kiln device takes the CPU's kernel choice (``native/attention.h``): where eager CPU runs ATen's
flash-attention kernels, the step records them (forward and backward) instead of the math path's
dozen ops; where eager falls back to math (dropout, head dims that differ, a last dim that is not
unit-strided), so does the device.  Every case is compared with eager CPU, output and the three
gradients, with a random cotangent.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

import kiln

S = (2, 4, 16, 8)
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _heads_last(shape: tuple[int, ...]) -> torch.Tensor:
    """(B, H, L, E) laid out as (B, L, H, E), as transformers passes q/k/v."""
    b, h, n, e = shape
    return torch.randn(b, n, h, e).transpose(1, 2)


CASES = {
    "causal": ({"is_causal": True}, [S, S, S], True),
    "no_mask": ({}, [S, S, S], True),
    "bool_mask": ({"attn_mask": torch.rand(16, 16) > 0.3}, [S, S, S], True),
    "float_mask": ({"attn_mask": torch.randn(2, 1, 16, 16)}, [S, S, S], True),
    "scale_causal": ({"scale": 0.3, "is_causal": True}, [S, S, S], True),
    "gqa": ({"enable_gqa": True}, [S, (2, 2, 16, 8), (2, 2, 16, 8)], True),
    "l_ne_s_causal": ({"is_causal": True}, [(2, 4, 5, 8), S, S], True),
    "value_dim_differs": ({}, [S, S, (2, 4, 16, 5)], False),
    "single_token": ({"is_causal": True}, [(2, 4, 1, 8)] * 3, True),
    "heads_last": ({"is_causal": True}, ["heads_last"] * 3, True),
    "empty_batch": ({}, [(0, 4, 16, 8)] * 3, None),
}


def _make(shape) -> torch.Tensor:
    return _heads_last(S) if shape == "heads_last" else torch.randn(shape)


def _run(fn, xs, cot, dev=None):
    leaves = [x.detach().clone() for x in xs]
    if dev is not None:
        leaves = [x.to(dev) for x in leaves]
    leaves = [x.requires_grad_(True) for x in leaves]
    with profile() as prof:
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, cot if dev is None else cot.to(dev))
        if dev is not None:
            kiln.mark_step()
    ran = {e.name for e in prof.events()}
    return out.detach().cpu(), [g.cpu() for g in grads], ran


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdpa_on_the_device_matches_eager(name: str, lazy_recorder: str) -> None:
    torch.manual_seed(0)
    kw, shapes, flash = CASES[name]
    xs = [_make(s) for s in shapes]

    def fn(q, k, v):
        # the mask on q's device, as a user moves it with the model's inputs
        on = {a: b.to(q.device) if isinstance(b, torch.Tensor) else b for a, b in kw.items()}
        return F.scaled_dot_product_attention(q, k, v, **on)

    cot = torch.randn(fn(*xs).shape)
    eo, eg, eager_ran = _run(fn, xs, cot)
    ko, kg, recorded = _run(fn, xs, cot, kiln.device())
    torch.testing.assert_close(ko, eo, rtol=1e-5, atol=1e-6)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if flash is not None:
        assert (FLASH in eager_ran) == flash  # the case is what it says
    if lazy_recorder == "native" and flash is not None:
        # the device takes eager's choice: the flash kernels where eager runs them
        assert (FLASH in recorded) == flash
        assert (FLASH + "_backward" in recorded) == flash


def test_sdpa_reading_a_view_whose_last_stride_differs_from_eager(lazy_recorder: str) -> None:
    """q is a view of a Kiln kernel's output, which Kiln writes contiguous where eager keeps its
    input's permuted layout: the flash kernel (unit last stride assumed) must not read it as eager's
    layout."""
    torch.manual_seed(0)
    xs = [torch.randn(S) for _ in range(3)]

    def fn(x, k, v):
        q = (x.transpose(-1, -2) * 2).transpose(-1, -2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cot = torch.randn(S)
    eo, eg, _ = _run(fn, xs, cot)
    ko, kg, _ = _run(fn, xs, cot, kiln.device())
    torch.testing.assert_close(ko, eo, rtol=1e-5, atol=1e-6)
    for a, b in zip(kg, eg):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
