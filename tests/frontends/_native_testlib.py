"""Shared helpers of the native recorder's tests: the module fixture that loads it (skipping, with
the reason, where it cannot be built), and running a function on native tensors against eager."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _process_testlib import clean_env

import kiln
from kiln.frontends.lazy import native


@pytest.fixture(scope="module", autouse=True)
def recorder():
    try:
        native.load()
    except native.NativeUnavailable as e:
        pytest.skip(f"native recorder unavailable: {e}")
    native.mark_step()  # nothing pending from elsewhere


@pytest.fixture(scope="module")
def native_device():
    """The kiln device with the native recorder as its recorder (``config.lazy_recorder =
    "native"``) for a module's tests; a module uses it with ``pytestmark =
    pytest.mark.usefixtures("native_device")`` after importing it."""
    with device_recorder("native"):
        yield


@contextlib.contextmanager
def device_recorder(name: str) -> Iterator[None]:
    """The kiln device records with ``name`` ("python" or "native") inside the block (skips the
    test, with the reason, where the native recorder cannot be built); nothing pending crosses
    the switch either way."""
    if name == "native":
        try:
            native.load()
        except native.NativeUnavailable as e:
            pytest.skip(f"native recorder unavailable: {e}")
    before = kiln.config.lazy_recorder
    kiln.mark_step()
    kiln.config.update(lazy_recorder=name)
    try:
        yield
    finally:
        kiln.mark_step()
        kiln.config.update(lazy_recorder=before)


def on_kiln_device(fn, *tensors: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``fn`` of ``tensors`` moved to the kiln device, then ``mark_step``: (its result on the CPU,
    ``kiln.metrics.counters()`` of that step alone)."""
    dev = kiln.device()
    kiln.metrics.reset()
    out = fn(*(t.to(dev) for t in tensors))
    kiln.mark_step()
    return out.cpu(), kiln.metrics.counters()


def raised(fn, *args) -> str:
    """``type: message`` of what ``fn(*args)`` (then ``mark_step``) raised; fails if nothing."""
    try:
        fn(*args)
        kiln.mark_step()
    except Exception as e:  # noqa: BLE001 - the message is what is compared
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{fn} raised nothing")


def run_native(fn, *inputs):
    """``fn`` on native tensors holding ``inputs``: (CPU results, the cut)."""
    xs = [native.tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    outs = fn(*xs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    del xs
    cut = native.mark_step()
    return [native.cpu(o) for o in outs], cut


def check(fn, *inputs, exact=False):
    got, cut = run_native(fn, *inputs)
    want = fn(*inputs)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if exact:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        else:
            torch.testing.assert_close(g, w, equal_nan=True)
    return cut


# the inputs of the per-op tests: odd sizes, one element, no rows, non-contiguous
SHAPES = {
    "odd": lambda: torch.randn(5, 7),
    "one": lambda: torch.randn(1, 1),
    "size0": lambda: torch.randn(0, 6),
    "noncontiguous": lambda: torch.randn(9, 6).t()[:, ::2],
}


def python_calls_since(before: dict[str, int], ops: set[str] | None = None) -> dict[str, int]:
    """The Python fallback's calls per op since ``before`` (``native.python_ops()`` then), of
    ``ops`` only when given."""
    now = native.python_ops()
    return {
        k: v - before.get(k, 0)
        for k, v in now.items()
        if v > before.get(k, 0) and (ops is None or k in ops)
    }


def on_device_and_eager(fn, x: torch.Tensor, a: torch.Tensor) -> dict:
    """``fn(x, a)`` and the gradient of ``sum(fn(x, a) ** 2)`` with respect to ``x``, on the kiln
    device (``x`` keeps its geometry there: non-contiguous stays so) and in eager: the device's
    ``out`` and ``grad`` (CPU tensors), eager's ``want_out`` and ``want_grad``, and ``python``:
    the Python fallback's calls per op while the device recorded the forward and backward."""
    xr = x.clone().requires_grad_()
    out_r = fn(xr, a)
    (out_r * out_r).sum().backward()
    kiln.mark_step()
    xl = x.to(kiln.device()).requires_grad_()
    al = a.to(kiln.device())
    before = dict(native.python_ops())
    out_l = fn(xl, al)
    (out_l * out_l).sum().backward()
    python = python_calls_since(before)
    kiln.mark_step()
    return {
        "out": out_l.cpu(),
        "grad": xl.grad.cpu(),
        "want_out": out_r.detach(),
        "want_grad": xr.grad,
        "python": python,
    }


def check_same_graph_as_the_python_recorder(
    program, inputs: tuple, cpp_ops: set[str], allowed: frozenset[str] = frozenset()
) -> None:
    """``program(*inputs)`` recorded by the native recorder (``run_native``, the kiln device on
    the Python recorder meanwhile) converts to node for node the graph the Python recorder
    compiles for it (equal structural hash), with no call of ``cpp_ops`` but the ``allowed`` ones
    through the Python fallback; both recorders' values are eager's."""
    from kiln.runtime import compiler

    kiln.config.update(lazy_recorder="python")
    try:
        before = dict(native.python_ops())
        got, cut = run_native(program, *inputs)
        python = set(python_calls_since(before, cpp_ops))
        assert python <= allowed, f"table ops through the Python fallback: {python - allowed}"
        g = native.graph_of(cut.graph_id)
        out = program(*(t.to(kiln.device()) for t in inputs))
        kiln.mark_step()
    finally:
        kiln.config.update(lazy_recorder="native")
    hashes = [e.source_graph_hash for e in compiler.executables()]
    assert g.hash in hashes, f"native graph not compiled by the kiln device:\n{g}"
    want = program(*inputs)
    for k, (a, b, c) in enumerate(zip(got, [o.cpu() for o in out], want)):
        torch.testing.assert_close(a, c, msg=f"native output {k}")
        torch.testing.assert_close(b, c, msg=f"Python recorder output {k}")


ROOT = Path(__file__).resolve().parents[2]


def run_native_child(
    code: str, case: str, tmp_path: Path, **env: str
) -> subprocess.CompletedProcess:
    """``python -c code case`` in a fresh process whose kiln device records with the native
    recorder (``KILN_LAZY_RECORDER=native``, its own cache under ``tmp_path``, no other ``KILN_*``
    variable of this process; ``env`` adds more or overrides, e.g. ``KILN_LAZY_RECORDER="python"``),
    this checkout first on the path."""
    full = clean_env()
    full.update(
        KILN_LAZY_RECORDER="native",
        KILN_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")]),
    )
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, case],
        check=False,
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
