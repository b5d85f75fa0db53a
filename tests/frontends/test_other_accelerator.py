"""``import kiln`` on a machine where PyTorch has another accelerator (cuda, xpu, mps).

Naming PyTorch's PrivateUse1 slot makes PyTorch treat it as the process's accelerator, which
breaks cuda backward passes (pytorch/pytorch#161129; seen on an H200: "opt_ready_stream &&
opt_parent_stream INTERNAL ASSERT FAILED").  So with another accelerator present ``import kiln``
leaves the slot unnamed and ``kiln.device()`` registers it when first asked for, with a warning.
This runs on any machine: a fresh process makes PyTorch report a cuda accelerator before
``import kiln`` (test_do_no_harm_cuda.py checks the real thing where CUDA exists).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from _process_testlib import run_clean

_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch

    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cuda")
    import kiln

    record = {"slot_after_import": torch._C._get_privateuse1_backend_name()}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    eager = torch.nn.functional.mse_loss(model(x), y)
    eager.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dev = kiln.device()
    record["warnings"] = [str(w.category.__name__) for w in caught]
    record["slot_after_device"] = torch._C._get_privateuse1_backend_name()
    model.zero_grad()
    model.to(dev)
    loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
    loss.backward()
    kiln.mark_step()
    record["loss_diff"] = abs(float(loss.cpu()) - float(eager))
    record["grad_diff"] = max(
        float((p.grad.cpu() - g).abs().max()) for p, g in zip(model.parameters(), grads)
    )
    print(json.dumps(record))
    """
)


def _python(script: str) -> str:
    """``script`` in a fresh interpreter without KILN_* settings; its standard output."""
    return run_clean("-c", script)


def test_device_registers_at_first_use_when_another_accelerator_is_present():
    r = json.loads(_python(_SCRIPT).splitlines()[-1])
    assert r["slot_after_import"] == "privateuseone"  # import kiln left the slot alone
    assert r["warnings"] == ["AcceleratorConflictWarning"]
    assert r["slot_after_device"] == "kiln"
    assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a cuda accelerator")
def test_import_registers_the_device_when_no_other_accelerator_is_present():
    script = (
        "import torch, kiln; "
        "print(torch._C._get_privateuse1_backend_name(), torch.device('kiln', 0))"
    )
    assert _python(script).split() == ["kiln", "kiln:0"]
