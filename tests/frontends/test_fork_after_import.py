"""Kiln leaves fork-based multiprocessing as PyTorch has it.

PyTorch refuses autograd in a forked child once the parent's autograd engine has started a device
thread, which it does at the parent's first backward pass when a device guard is registered.  Kiln
registers its guard at ``import kiln`` only (nothing at ``import torch``), and checks the engine
at the first use of the device, not at import (the check is a backward pass).  So:

- a program that never imports kiln, in an environment with kiln installed, runs a backward pass,
  forks, and the child runs autograd (as without kiln);
- a program that imports kiln and forks before any backward pass: the child trains on the CPU
  and on the kiln device with the same numbers as eager.
"""

from __future__ import annotations

from _subprocess import start_python

_FORK = r"""
import os, sys
import torch

def child(body):
    pid = os.fork()
    if pid == 0:
        try:
            body()
            print("CHILD OK", flush=True)
            os._exit(0)
        except BaseException as e:
            print(f"child failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
"""

_WITHOUT_KILN = (
    _FORK
    + r"""
y = torch.randn(3, requires_grad=True)
(y * y).sum().backward()                    # the parent's first backward pass

def body():
    x = torch.randn(4, 4, requires_grad=True)
    (x * x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x)
    assert "kiln" not in sys.modules

child(body)
"""
)

_WITH_KILN = (
    _FORK
    + r"""
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

def body():
    want_loss, want_grads = step("cpu")
    loss, grads = step(kiln.device())
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)

child(body)
"""
)


def test_forked_children_run_autograd():
    # fresh processes side by side
    procs = {
        "backward, fork, no kiln": start_python(_WITHOUT_KILN),
        "import kiln, fork": start_python(_WITH_KILN),
        "import kiln, fork, autoload off": start_python(
            _WITH_KILN, TORCH_DEVICE_BACKEND_AUTOLOAD="0"
        ),
    }
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "CHILD OK" in out, (name, err[-3000:])
