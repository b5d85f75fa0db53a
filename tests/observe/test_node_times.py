"""kiln.observe.node_times: the native launcher's per-node wall times, read while graphs run as
they always do (kernels, ATen calls), off outside the block, and nothing where graphs do not run
on the launcher."""

from __future__ import annotations

import torch

import kiln
from kiln.codegen.cpp import launcher
from kiln.codegen.cpp.executor import take_node_times
from kiln.observe.node_times import node_times


def _fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # an ATen GEMM
    return (torch.relu(h) * 2.0 + 1.0).sum(-1)  # one generated kernel


def _compiled():
    torch._dynamo.reset()
    return torch.compile(_fn, backend="kiln")


def test_kernels_and_aten_calls_are_timed_per_run():
    assert launcher.available()
    fn = _compiled()
    x, w = torch.randn(32, 16), torch.randn(16, 24)
    want = _fn(x, w)
    torch.testing.assert_close(fn(x, w), want)  # compiled (and warmed) before the block
    with node_times() as times:
        for _ in range(7):
            got = fn(x, w)
    torch.testing.assert_close(got, want)  # the timed runs compute the same
    assert times.native
    kinds = times.by_kind()
    assert set(kinds) >= {"kernel", "aten"}, times.seconds
    kernels = [k for k in times.calls if k[0] == "kernel"]
    assert kernels and all(k[1].startswith("kiln_") for k in kernels)
    assert all(times.calls[k] == 7 for k in kernels)  # once per run
    assert times.calls[("aten", "mm.default")] == 7
    assert all(s > 0 for s in times.seconds.values())
    assert abs(times.total - sum(kinds.values())) < 1e-12
    table = times.table(steps=7)
    assert "mm.default" in table and kernels[0][1] in table
    # off after the block: later runs record nothing
    fn(x, w)
    assert take_node_times() == []


def test_nothing_recorded_off_the_launcher():
    kiln.config.update(launcher=False)
    try:
        fn = _compiled()
        x, w = torch.randn(8, 4), torch.randn(4, 5)
        fn(x, w)
        with node_times() as times:
            got = fn(x, w)
    finally:
        kiln.config.update(launcher=True)
    torch.testing.assert_close(got, _fn(x, w))
    # graphs compiled earlier in the process still sit on the launcher: none of them ran here
    assert not times.native
    assert times.seconds == {}
    assert times.total == 0.0
