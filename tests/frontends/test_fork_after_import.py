"""``import kiln`` leaves fork-based multiprocessing working.

PyTorch refuses autograd in a forked child once the parent's autograd engine has started its
device threads (its first backward pass with a device guard registered).  ``import kiln`` must
not start them: with autoload off, kiln probes whether the engine can serve its device at the
first use of the device, not at import (the probe is a backward pass).  A forked child then
trains on the CPU and on the kiln device, with the same numbers as eager.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD_TRAINS = r"""
import os, sys
import torch
import kiln

def step(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    model = model.to(dev)
    x = torch.randn(4, 5).to(dev)
    loss = model(x).square().mean()
    loss.backward()
    kiln.mark_step()
    return loss.detach().cpu(), [p.grad.detach().cpu() for p in model.parameters()]

pid = os.fork()
if pid == 0:
    try:
        want_loss, want_grads = step("cpu")
        loss, grads = step(kiln.device())
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        print("CHILD TRAINED", flush=True)
        os._exit(0)
    except BaseException as e:
        print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _start(**env: str) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    e.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD_TRAINS],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_forked_child_trains_after_import_kiln():
    # two fresh processes side by side: the device guard registered at ``import torch``
    # (autoload, the default) and by ``import kiln`` itself (autoload off)
    procs = {"autoload": _start(), "no autoload": _start(TORCH_DEVICE_BACKEND_AUTOLOAD="0")}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "CHILD TRAINED" in out, (name, err[-3000:])
