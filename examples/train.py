"""Kiln's main job: train a small GPT on the built-in corpus in three modes, side by side.

    python examples/train.py                 # 30 steps: eager, kiln lazy device, kiln compile
    python examples/train.py --steps 100 --layers 4

Every mode starts from the same weights and sees the same batches; the modes take turns step by
step (so a busy machine slows them alike).  The table shows the loss of each mode at a few steps
(they agree to ~1e-5), the first step (compiles included) and the median step time after warm-up.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kiln  # noqa: E402
from examples.tinygpt import GPT, GPTConfig, batches  # noqa: E402


def make_step(mode: str, model: torch.nn.Module, lr: float) -> tuple[Callable, torch.device]:
    """One mode's training step (forward, backward, AdamW, zero_grad) and the device it runs on."""
    dev = kiln.device() if mode == "lazy" else torch.device("cpu")
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return (kiln.compile(step) if mode == "compile" else step), dev


def run_interleaved(
    modes: Sequence[str], base: torch.nn.Module, data: list, lr: float
) -> dict[str, tuple[list, list]]:
    """Train every mode on its own copy of ``base``, one step of each mode in turn (the order
    rotating), so that a busy machine slows every mode alike: per mode (losses, step seconds)."""
    steps = {m: make_step(m, copy.deepcopy(base), lr) for m in modes}
    results: dict[str, tuple[list, list]] = {m: ([], []) for m in modes}
    for i, (x, y) in enumerate(data):
        k = i % len(modes)
        for mode in [*modes[k:], *modes[:k]]:
            step, dev = steps[mode]
            t0 = time.perf_counter()
            loss = step(x.to(dev), y.to(dev))
            if mode == "lazy":
                kiln.mark_step()
            value = loss.item()
            results[mode][1].append(time.perf_counter() - t0)
            results[mode][0].append(value)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    a = ap.parse_args()
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=a.layers, block_size=a.block))
    data = list(batches(a.batch, a.block, a.steps))
    results = run_interleaved(("eager", "lazy", "compile"), base, data, a.lr)
    warm = min(3, a.steps - 1)
    print(f"\nGPT {a.layers} layers, batch {a.batch}x{a.block}, AdamW, {a.steps} steps")
    print(f"{'step':>6} " + " ".join(f"{m:>12}" for m in results))
    shown = sorted({0, 1, a.steps // 2, a.steps - 1})
    for i in shown:
        print(f"{i + 1:>6} " + " ".join(f"{results[m][0][i]:>12.6f}" for m in results))
    print(f"{'1st ms':>6} " + " ".join(f"{r[1][0] * 1e3:>12.0f}" for r in results.values()))
    med = {m: statistics.median(r[1][warm:]) * 1e3 for m, r in results.items()}
    print(f"{'ms/step':>6} " + " ".join(f"{med[m]:>12.2f}" for m in results))
    print(f"{'vs eager':>6} " + " ".join(f"{med['eager'] / med[m]:>11.2f}x" for m in results))
    drift = max(
        abs(results[m][0][i] - results["eager"][0][i]) / abs(results["eager"][0][i])
        for m in ("lazy", "compile")
        for i in range(a.steps)
    )
    print(f"max relative loss drift vs eager: {drift:.2e}")
    print()
    print(kiln.metrics.report())
    if drift > 1e-4:
        sys.exit(f"loss drift {drift:.2e} exceeds 1e-4")


if __name__ == "__main__":
    main()
