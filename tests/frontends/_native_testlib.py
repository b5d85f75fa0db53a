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


ROOT = Path(__file__).resolve().parents[2]


def run_native_child(
    code: str, case: str, tmp_path: Path, **env: str
) -> subprocess.CompletedProcess:
    """``python -c code case`` in a fresh process whose kiln device records with the native
    recorder (``KILN_LAZY_RECORDER=native``, its own cache under ``tmp_path``, no other ``KILN_*``
    variable of this process; ``env`` adds more or overrides, e.g. ``KILN_LAZY_RECORDER="python"``),
    this checkout first on the path."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
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
