"""Short versions of the MLP study (bench/precision_mlp.py runs the full 2,000 steps x 3 seeds).

Calibrated on this machine: at 150 steps, seed 0, final loss fp32 1.939e-3, bf16 + SR 1.940e-3
(1.001x), bf16 round-to-nearest 3.526e-3 (1.82x).  Here 100 steps, mean of the last 20 losses."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench/

from bench.precision_study import final_loss, train

STEPS = 100


def test_compiled_bf16_sr_tracks_fp32_and_rne_stalls():
    ref = final_loss(train("fp32", 0, STEPS), 20)
    sr = final_loss(train("bf16-sr", 0, STEPS), 20)
    rne = final_loss(train("bf16-rne", 0, STEPS), 20)
    assert abs(sr / ref - 1) < 0.05, (ref, sr, rne)
    assert rne / ref > 1.3, (ref, sr, rne)


def test_fp8_mlp_trains_like_bf16():
    fp8 = train("fp8", 0, 40)  # 1.011-1.012x autocast at 2,000 steps over 3 seeds
    bf16 = final_loss(train("autocast", 0, 40), 20)
    assert all(math.isfinite(v) for v in fp8)
    assert final_loss(fp8, 20) < 1.10 * bf16, (final_loss(fp8, 20), bf16)
