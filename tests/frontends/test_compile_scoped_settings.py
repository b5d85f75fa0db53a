"""What the compile backend changes for the length of its own calls, and only then.

- CPython's cyclic garbage collector is off during a backend call (AOTAutograd + Kiln's compile)
  and back on after it, also when the call fails; a program that turned it off keeps it off.
- AOTAutograd's cache key, for Kiln's calls, leaves out Inductor's code generators (their
  registration imports them all): the key is the same in a process where Inductor registered
  them and in one where nothing did, and ``torch._inductor.codecache`` is as it was after the call.
"""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
from _subprocess import run_json

import kiln  # noqa: F401 - registers the backend
from kiln.frontends.compile import backend


def _check_against_eager(op) -> None:
    """Compile ``op(x @ w).square().sum()`` (a new graph per ``op``: Kiln compiles it, no cache
    serves it) and compare its value and gradient with eager's."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return op(x @ w).square().sum()

    x = torch.randn(5, 3)
    w = torch.randn(3, 7, requires_grad=True)
    we = w.detach().clone().requires_grad_(True)
    out = torch.compile(f, backend="kiln")(x, w)
    out.backward()
    ref = f(x, we)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w.grad, we.grad)


def _recording_gc_state(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    real = backend.compile_graph

    def recording(g):
        seen.append(gc.isenabled())
        return real(g)

    monkeypatch.setattr(backend, "compile_graph", recording)
    return seen


def test_gc_paused_during_the_backend_call_and_on_after(monkeypatch):
    seen = _recording_gc_state(monkeypatch)
    torch._dynamo.reset()
    assert gc.isenabled()
    _check_against_eager(torch.tanh)
    torch._dynamo.reset()
    assert seen and not any(seen), seen  # forward and backward compiled with the collector off
    assert gc.isenabled()


def test_gc_stays_off_when_the_program_turned_it_off(monkeypatch):
    seen = _recording_gc_state(monkeypatch)
    torch._dynamo.reset()
    gc.disable()
    try:
        _check_against_eager(torch.sigmoid)
        assert not gc.isenabled()
    finally:
        gc.enable()
        torch._dynamo.reset()
    assert seen and not any(seen)


def test_gc_back_on_when_the_backend_call_fails(monkeypatch):
    def failing(g):
        raise RuntimeError("kiln test: compile failed on purpose")

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.atan(x @ w).sum()

    monkeypatch.setattr(backend, "compile_graph", failing)
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="compile failed on purpose"):
            torch.compile(f, backend="kiln")(torch.randn(5, 3), torch.randn(3, 7))
    finally:
        torch._dynamo.reset()
    assert gc.isenabled()


KEY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, kiln
    import torch._inductor.codecache as cc
    from torch._dynamo.utils import counters
    from kiln.frontends.compile import aot_cache

    if sys.argv[1] == "registered":  # as in a process where Inductor compiled something first
        from torch._inductor.codegen.common import init_backend_registration
        init_backend_registration()
    before = (cc.init_backend_registration, cc.custom_backend_passes,
              cc.custom_backend_codegen_configs)

    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum()

    torch.manual_seed(0)
    x, w = torch.randn(6, 5), torch.randn(5, 3, requires_grad=True)
    out = torch.compile(f, backend="kiln")(x, w)
    out.backward()
    after = (cc.init_backend_registration, cc.custom_backend_passes,
             cc.custom_backend_codegen_configs)
    print(json.dumps({
        "hit": counters["aot_autograd"]["autograd_cache_hit"],
        "miss": counters["aot_autograd"]["autograd_cache_miss"],
        "out": out.item(),
        "grad": w.grad.flatten().tolist(),
        "restored": all(a is b for a, b in zip(before, after)),
        "codegen_imported": "torch._inductor.codegen.cpp" in sys.modules,
    }))
    """
)


def test_aot_key_is_the_same_with_and_without_inductor_registration(tmp_path):
    cache = str(tmp_path / "cache")
    plain = run_json(KEY_SCRIPT, "plain", KILN_CACHE_DIR=cache)
    assert plain["miss"] == 1 and plain["hit"] == 0
    assert plain["restored"]
    registered = run_json(KEY_SCRIPT, "registered", KILN_CACHE_DIR=cache)
    assert registered["hit"] == 1 and registered["miss"] == 0, registered
    assert registered["restored"]
    assert registered["out"] == plain["out"] and registered["grad"] == plain["grad"]
    # and the other way round: an entry written where Inductor had registered serves a plain one
    cache2 = str(tmp_path / "cache2")
    first = run_json(KEY_SCRIPT, "registered", KILN_CACHE_DIR=cache2)
    assert first["miss"] == 1
    second = run_json(KEY_SCRIPT, "plain", KILN_CACHE_DIR=cache2)
    assert second["hit"] == 1 and second["miss"] == 0, second
    assert second["out"] == plain["out"] and second["grad"] == plain["grad"]
    # a cache hit ran no partitioner (whose CSE imports Inductor's lowering), and the key did not
    # import Inductor's code generators either (~0.5 s of CPU in a warm start)
    assert not second["codegen_imported"]
