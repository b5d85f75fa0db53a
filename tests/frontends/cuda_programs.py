"""Eager CUDA training programs for test_do_no_harm_cuda.py, run in a fresh process.

    python cuda_programs.py [--kiln | --kiln-late]

Prints one JSON line per program with a digest of its results.  ``--kiln`` imports kiln first;
``--kiln-late`` trains on CUDA first, then imports kiln, trains on CUDA again, then asks for the
kiln device (a warning: PyTorch then treats it as the process's accelerator) and trains on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch.utils.checkpoint import checkpoint

torch.use_deterministic_algorithms(True)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 8)
    )


def train(
    device: str, *, ckpt: bool = False, amp: bool = False, steps: int = 5
) -> tuple[str, list[torch.Tensor]]:
    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g).to(device)
        y = torch.randn(16, 8, generator=g).to(device)
        opt.zero_grad()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=amp):
            out = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    results = [torch.stack(losses).cpu(), *(p.detach().cpu() for p in model.parameters())]
    return _digest(*results), results


PROGRAMS = {
    "cuda_plain": lambda: train("cuda")[0],
    "cuda_checkpoint": lambda: train("cuda", ckpt=True)[0],
    "cuda_autocast_checkpoint": lambda: train("cuda", ckpt=True, amp=True)[0],
}


def main() -> None:
    if "--kiln" in sys.argv:
        import kiln
    for name, run in PROGRAMS.items():
        print(json.dumps({"program": name, "digest": run()}), flush=True)
    if "--kiln-late" in sys.argv:
        import warnings

        import kiln

        for name, run in PROGRAMS.items():
            print(json.dumps({"program": name + "_after_import", "digest": run()}), flush=True)
        # the kiln device, asked for in a process that trains on cuda: registered now, with a warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dev = kiln.device()
        warned = any(issubclass(w.category, kiln.AcceleratorConflictWarning) for w in caught)
        _, on_cpu = train("cpu")
        _, on_kiln = train(str(dev))
        worst = max(float((a - b).abs().max()) for a, b in zip(on_kiln, on_cpu))
        close = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(on_kiln, on_cpu))
        try:
            train("cuda", steps=1)
            cuda_after = "ok"
        except RuntimeError as e:
            cuda_after = str(e).splitlines()[0][:200]
        record = {
            "program": "kiln_device",
            "warned": warned,
            "max_abs_diff": worst,
            "close": close,
            "cuda_backward_after": cuda_after,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
