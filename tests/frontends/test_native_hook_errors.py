"""A Python error raised inside a backward pass on kiln tensors -- a post-accumulate-grad hook
(what ``kiln.distributed.GradientSync`` uses), a tensor hook, an ``autograd.Function``'s
backward -- reaches ``backward()`` as that Python exception, and the process goes on training,
with either recorder (the default Python one and the native one).

Before lazy/guard.h the kiln device's guard was PyTorch's Python device guard, whose
``noexcept`` stream functions call into Python: the autograd engine unwinding from the hook with
the Python error still pending called them, the call failed, and the process ended with SIGABRT
("terminate called without an active exception").  Each case runs in a fresh process for that
reason: the failure before the fix is the child's death, not an exception here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _native_testlib import run_native_child

_CHILD = r"""
import json, sys
import torch
import kiln
from kiln.frontends.lazy import device_guard, native

case, recorder = sys.argv[1].split(":")
if recorder == "native":
    native.load()
dev = kiln.device()
torch.manual_seed(0)
w_ref = torch.randn(5, 3, requires_grad=True)
x = torch.randn(7, 5)
w = w_ref.detach().to(dev).requires_grad_()
xd = x.to(dev)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        raise ValueError("planted error in Function.backward")


def planted(*a):
    raise ValueError(f"planted error in a {case} hook")


if case == "post_accumulate":
    handle = w.register_post_accumulate_grad_hook(planted)
elif case == "tensor":
    handle = w.register_hook(planted)
out = {"native": native.is_native(w), "cpp_guard": device_guard.installed() or native.loaded()}
try:
    y = Boom.apply(xd @ w) if case == "function" else xd @ w
    y.sum().backward()
    out["raised"] = None
except Exception as e:
    out["raised"] = [type(e).__name__, str(e)]
if case != "function":
    handle.remove()
kiln.mark_step()
# the process goes on: a training step afterwards matches eager
w.grad = None
loss = (xd @ w).relu().pow(2).mean()
loss.backward()
kiln.mark_step()
ref = (x @ w_ref).relu().pow(2).mean()
ref.backward()
torch.testing.assert_close(loss.cpu(), ref.detach())
torch.testing.assert_close(w.grad.cpu(), w_ref.grad)
out["trained"] = True
print(json.dumps(out))
"""


def _run(case: str, recorder: str, tmp_path: Path) -> dict:
    p = run_native_child(_CHILD, f"{case}:{recorder}", tmp_path, KILN_LAZY_RECORDER=recorder)
    if "native recorder unavailable" in p.stderr or "NativeUnavailable" in p.stderr:
        pytest.skip("native recorder unavailable: " + p.stderr[-500:])
    assert p.returncode == 0, (p.returncode, p.stderr[-4000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recorder", ["python", "native"])
@pytest.mark.parametrize("case", ["post_accumulate", "tensor", "function"])
def test_python_error_in_backward_raises_instead_of_aborting(case, recorder, tmp_path):
    out = _run(case, recorder, tmp_path)
    assert out["native"] == (recorder == "native"), out
    assert out["cpp_guard"], out
    assert out["raised"] is not None, out
    kind, msg = out["raised"]
    assert kind == "ValueError", out["raised"]
    assert "planted error" in msg, out["raised"]
    assert out["trained"]


def test_native_recorder_installs_its_device_guard():
    """Loading the recorder makes its C++ guard the kiln device's guard (in this process too)."""
    from kiln.frontends.lazy import native

    try:
        mod = native.load()
    except native.NativeUnavailable as e:
        pytest.skip(f"native recorder unavailable: {e}")
    assert mod.device_guard_installed()
    assert not mod.install_device_guard()  # idempotent: already the guard


def test_device_guard_build_failure_keeps_the_python_guard_with_a_warning(tmp_path, monkeypatch):
    """A guard that cannot be built (here: a source g++ rejects) leaves the device working on
    PyTorch's Python guard, says so once and counts it."""
    from kiln import metrics
    from kiln.codegen.cpp.extension import Extension
    from kiln.config import config
    from kiln.frontends.lazy import device_guard

    bad = tmp_path / "guard.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(config, "launcher_dir", str(tmp_path / "ext"))
    monkeypatch.setattr(
        device_guard, "_EXT", Extension("kiln_device_guard", bad, ["-w"], "C++ device guard")
    )
    before = metrics.get("device_guard_unavailable")
    with pytest.warns(RuntimeWarning, match="C\\+\\+ device guard is unavailable"):
        assert device_guard.install() is False
    assert metrics.get("device_guard_unavailable") == before + 1
    assert device_guard.install() is False  # remembered: no second build, no second warning
    assert metrics.get("device_guard_unavailable") == before + 1
