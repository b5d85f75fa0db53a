"""Llama's rotary embedding alone, forward + backward: eager vs ``torch.compile(backend="kiln")``.

    python bench/rope_region.py            # median process CPU us per call, 1 thread

q (4x4x64x32) and k (4x2x64x32, grouped-query) come out of their projections' outputs through
``view`` + ``transpose`` as in transformers' Llama, cos/sin are 64x32; ``rotate_half`` is
transformers' own.  Each mode runs 200 calls per round, rounds interleaved, the first dropped.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kiln  # noqa: E402


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(xq, xk, cos, sin):
    q = xq.view(4, 64, 4, 32).transpose(1, 2)
    k = xk.view(4, 64, 2, 32).transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def main(rounds: int = 7, calls: int = 200) -> None:
    torch.set_num_threads(1)
    kiln.config.update(cache_dir=tempfile.mkdtemp(prefix="kiln-rope-"))
    xq = torch.randn(4, 64, 128, requires_grad=True)
    xk = torch.randn(4, 64, 64, requires_grad=True)
    cos, sin = torch.randn(1, 1, 64, 32), torch.randn(1, 1, 64, 32)
    gq, gk = torch.randn(4, 4, 64, 32), torch.randn(4, 2, 64, 32)
    modes = {"eager": rope, "kiln": torch.compile(rope, backend="kiln")}
    res: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for m, fn in modes.items():
            c0 = time.process_time()
            for _ in range(calls):
                qe, ke = fn(xq, xk, cos, sin)
                torch.autograd.backward((qe, ke), (gq, gk))
            if r:
                res[m].append((time.process_time() - c0) / calls * 1e6)
    med = {m: round(statistics.median(v), 1) for m, v in res.items()}
    print(f"RESULT {ROOT}: us/call {med}, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
