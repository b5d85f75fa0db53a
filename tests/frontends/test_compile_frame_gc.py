"""Dynamo's compile of a Kiln frame runs with CPython's cyclic collector paused
(kiln/frontends/compile/frame_gc.py): no collection during the frame's tracing, the collector
back on after it (or left off where the program turned it off), other backends untouched."""

from __future__ import annotations

import gc

import pytest
import torch

import kiln
from kiln.frontends.compile.backend import kiln_backend


def _chain(x: torch.Tensor) -> torch.Tensor:
    for i in range(120):  # enough traced ops that tracing allocates well past gc's thresholds
        x = (x * 1.01 + i).tanh() if i % 2 else x.sin() - 0.5
    return x.sum()


def _plain_kiln(gm, example_inputs, **kwargs):
    """Kiln's backend behind a function Kiln does not recognise as its own."""
    return kiln_backend(gm, example_inputs, **kwargs)


class _Collections:
    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.seen += 1


@pytest.mark.parametrize("backend,paused", [("kiln", True), (_plain_kiln, False), ("eager", False)])
def test_no_collection_while_kiln_traces_a_frame(backend, paused):
    kiln.compile(lambda: None)  # Kiln's wrappers are installed in this process
    torch._dynamo.reset()
    compiled = torch.compile(_chain, backend=backend)
    x = torch.randn(8)
    counter = _Collections()
    gc.collect()
    gc.callbacks.append(counter)
    try:
        out = compiled(x)
    finally:
        gc.callbacks.remove(counter)
    torch.testing.assert_close(out, _chain(x))
    assert gc.isenabled()
    if paused:
        assert counter.seen <= 2  # at most the young collections as the collector comes back
    else:
        assert counter.seen > 10


def test_collector_left_off_when_the_program_turned_it_off():
    kiln.compile(lambda: None)
    torch._dynamo.reset()
    compiled = torch.compile(_chain, backend="kiln")
    gc.disable()
    try:
        compiled(torch.randn(8))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collector_back_on_after_a_failed_compile():
    kiln.compile(lambda: None)
    torch._dynamo.reset()

    def broken(x):
        return x.sin() + undefined_name  # noqa: F821 - NameError while Dynamo traces

    compiled = torch.compile(broken, backend="kiln")
    with pytest.raises(NameError):
        compiled(torch.randn(3))
    assert gc.isenabled()
