"""Teacher-student MLP in fp32 / pure bf16 (round-to-nearest vs stochastic rounding) / fp8.

    python bench/precision_mlp.py                               # the full study (long)
    python bench/precision_mlp.py --steps 300 --seeds 0 --modes fp32,bf16-rne,bf16-sr

64-256-256-64 MLP, GELU, batch 256, AdamW lr 1e-4 (bench/precision_study.py).  Each run's final
loss (mean of the last 50 steps) is merged into ``--json`` as soon as it finishes (atomic write),
so a long study can be stopped and resumed; runs already in the file are skipped.  Then a markdown
table: final loss per mode and seed, and its ratio to fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.precision_study import MODES, final_loss, train

DEFAULT_MODES = "fp32,bf16-sr,bf16-rne,lazy-bf16-sr,lazy-bf16-rne,autocast,fp8"


def _save(path: str, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def table(data: dict, steps: int) -> str:
    runs = {k: v for k, v in data.items() if v["steps"] == steps}
    modes = [m for m in MODES if any(v["mode"] == m for v in runs.values())]
    seeds = sorted({v["seed"] for v in runs.values()})
    ref = {v["seed"]: v["final"] for v in runs.values() if v["mode"] == "fp32"}
    head = ["mode"] + [f"seed {s}" for s in seeds] + ["/ fp32 (per seed)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in modes:
        cells, ratios = [], []
        for s in seeds:
            v = runs.get(f"{m}/{s}/{steps}")
            cells.append(f"{v['final']:.3e}" if v else "-")
            if v and s in ref:
                ratios.append(f"{v['final'] / ref[s]:.3f}")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {', '.join(ratios) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default=DEFAULT_MODES)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "precision_mlp.json"))
    a = ap.parse_args(argv)
    data = _load(a.json)
    for seed in [int(s) for s in a.seeds.split(",")]:
        for mode in a.modes.split(","):
            key = f"{mode}/{seed}/{a.steps}"
            if key in data:
                continue
            t0 = time.perf_counter()
            losses = train(mode, seed, a.steps)
            bad = sum(1 for v in losses if not math.isfinite(v))
            run = {"mode": mode, "seed": seed, "steps": a.steps, "final": final_loss(losses),
                   "nonfinite": bad, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
            print(json.dumps(run), flush=True)
            data = _load(a.json)
            data[key] = run
            _save(a.json, data)
    print(table(data, a.steps))


if __name__ == "__main__":
    main()
