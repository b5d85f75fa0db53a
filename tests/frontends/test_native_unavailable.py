"""Stage 8's fallback: with ``KILN_LAZY_RECORDER=native`` and a recorder that cannot be built or
loaded (no C++ compiler, a failed build), the kiln device uses the Python recorder instead, with
one warning naming the reason and the fix, counted once (``native_recorder_unavailable``).

Each case runs in a fresh process (the recorder's load failure is remembered per process): one
with ``CXX`` pointing at a missing compiler and an empty launcher directory (nothing cached to
load), one with the build itself failing (the loader's ``build`` replaced).  Both train a Linear
layer for two SGD steps on the kiln device and compare loss, gradients and parameters with eager.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _native_testlib import run_native_child

_CHILD = r"""
import copy, json, sys, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda m, c, *a, **k: caught.append((c.__name__, str(m)))
import torch
import kiln
from kiln import metrics
from kiln.frontends.lazy import native
from kiln.frontends.lazy.native import device as native_device
from kiln.frontends.lazy.tensor import LazyTensor

if sys.argv[1] == "build-error":
    from kiln.codegen.cpp.build import BuildError

    def failing(*a):
        raise BuildError("building the native lazy recorder failed: planted error 1234")

    native._EXT.build = failing

assert kiln.config.lazy_recorder == "native"
dev = kiln.device()
torch.manual_seed(0)
ref = torch.nn.Linear(5, 3)
model = copy.deepcopy(ref).to(dev)
x = torch.randn(7, 5)
xd = x.to(dev)
opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
losses = []
for _ in range(2):
    loss_ref = ref(x).pow(2).mean()
    loss_ref.backward()
    opt_ref.step()
    opt_ref.zero_grad()
    loss = model(xd).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    kiln.mark_step()
    losses.append((loss.item(), loss_ref.item()))
z = torch.zeros(2, 3, device=dev) + 1  # a later factory: no second warning, no second count
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p.cpu(), q.detach())
print(json.dumps({
    "types": sorted({type(t).__name__ for t in [xd, z, loss, *model.parameters()]}),
    "lazy": all(isinstance(t, LazyTensor) for t in [xd, z, loss, *model.parameters()]),
    "loaded": native.loaded(),
    "active": native_device.active(),
    "usable": native_device.usable(),
    "switch": kiln.config.lazy_recorder,
    "count": metrics.get("native_recorder_unavailable"),
    "warnings": [w for w in caught if w[0] == "NativeRecorderUnavailableWarning"],
    "losses": losses,
    "z": z.cpu().tolist(),
}))
"""


def _run(case: str, tmp_path: Path, extra_env: dict[str, str]) -> dict:
    # nothing built in the launcher dir: a build is needed
    p = run_native_child(
        _CHILD, case, tmp_path, KILN_LAUNCHER_DIR=str(tmp_path / "launcher"), **extra_env
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _check(out: dict, reason: str) -> None:
    assert out["types"] == ["LazyTensor"] and out["lazy"], out["types"]
    assert not out["loaded"] and not out["active"] and not out["usable"]
    assert out["switch"] == "native"  # the user's setting is left as it is
    assert out["count"] == 1
    assert len(out["warnings"]) == 1, out["warnings"]
    msg = out["warnings"][0][1]
    assert reason in msg
    assert "Python recorder instead" in msg
    assert "KILN_LAZY_RECORDER=python" in msg and "g++" in msg  # the fix
    for got, want in out["losses"]:
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert out["z"] == [[1.0] * 3] * 2


def test_no_compiler_falls_back_to_the_python_recorder(tmp_path):
    """CXX names a compiler that does not exist: the kiln device trains on the Python recorder
    (values equal eager's; the graphs run on the interpreter backend, which needs no compiler)."""
    missing = tmp_path / "no-such-g++"
    out = _run("no-compiler", tmp_path, {"CXX": str(missing), "KILN_BACKEND": "interpreter"})
    _check(out, f"no working C++ compiler ({missing})")


def test_failed_build_falls_back_to_the_python_recorder(tmp_path):
    """The recorder's build fails (the loader's ``build`` raises): same fallback, the build's
    error named in the warning.  (The graphs run on the Python executor: the native launcher
    would be built afresh in the empty launcher directory, ~20 s, and is not what is tested.)"""
    out = _run("build-error", tmp_path, {"KILN_LAUNCHER": "0"})
    _check(out, "planted error 1234")
