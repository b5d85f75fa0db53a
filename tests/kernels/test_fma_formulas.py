"""Formulas ATen's CPU kernels compute with a fused multiply-add match ATen bit for bit.

``add``/``sub`` with ``alpha``, ``addcmul``, ``lerp`` (both sides of its 0.5 switch) and
``tanh_backward``: one rounding for the multiply and the add, as ATen's kernels (built with
multiply-add contraction) do.  Rounding the product first differs in the last bit on a large share
of ordinary inputs and gives NaN or inf at overflow edges.  Both modes, all cases in one graph.
"""

from __future__ import annotations

import pytest
import torch

import kiln

aten = torch.ops.aten
N = 4096


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x, y, z = (torch.randn(N, generator=g) * 3 for _ in range(3))
    w = torch.rand(N, generator=g) * 1.4 - 0.2  # lerp weights on both sides of 0.5
    return {"x": x, "y": y, "z": z, "w": w, "t": torch.tanh(x)}


CASES = {
    "add_alpha": lambda d: aten.add.Tensor(d["x"], d["y"], alpha=0.3),
    "sub_alpha": lambda d: aten.sub.Tensor(d["x"], d["y"], alpha=1.7),
    "addcmul": lambda d: aten.addcmul.default(d["x"], d["y"], d["z"], value=-0.5),
    "addcmul_value_1": lambda d: aten.addcmul.default(d["x"], d["y"], d["z"]),
    "lerp_tensor": lambda d: aten.lerp.Tensor(d["x"], d["y"], d["w"]),
    "lerp_scalar": lambda d: aten.lerp.Scalar(d["x"], d["y"], 0.3),
    "tanh_backward": lambda d: aten.tanh_backward.default(d["y"], d["t"]),
}


def _all(d: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [fn(d) for fn in CASES.values()]


@pytest.mark.parametrize("mode", ["lazy", "compile"])
def test_fused_multiply_add_formulas_match_aten_bitwise(mode: str) -> None:
    d = _inputs()
    expected = _all(d)
    kiln.metrics.reset()
    if mode == "lazy":
        dev = kiln.device()
        got = _all({k: v.to(dev) for k, v in d.items()})
        kiln.mark_step()
        got = [t.cpu() for t in got]
    else:
        torch._dynamo.reset()
        got = torch.compile(_all, backend="kiln", dynamic=False)(d)
    c = kiln.metrics.counters()
    assert c.get("graphs_executed", 0) >= 1 and not c["fallbacks"], c["fallbacks"]
    for name, a, e in zip(CASES, got, expected):
        differ = int((a.view(torch.int32) != e.view(torch.int32)).sum())
        assert differ == 0, f"{mode} {name}: {differ} of {N} values differ from ATen in their bits"
