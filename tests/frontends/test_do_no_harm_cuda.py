"""On a machine with CUDA: importing kiln leaves eager CUDA training bit-identical (plain,
activation checkpointing, bf16 autocast with checkpointing), whether kiln is imported first or
after CUDA training has run, and the kiln device then trains in the same process (backward
included: the autograd engine already holds CUDA's device threads).  Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_SCRIPT = Path(__file__).with_name("cuda_programs.py")


def _run(*flags: str) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    p = subprocess.run(
        [sys.executable, str(_SCRIPT), *flags],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return {r["program"]: r for r in map(json.loads, p.stdout.splitlines())}


def test_cuda_training_is_bit_identical_with_and_without_import_kiln():
    plain, first, late = _run(), _run("--kiln"), _run("--kiln-late")
    names = ("cuda_plain", "cuda_checkpoint", "cuda_autocast_checkpoint")
    for name in names:
        assert plain[name]["digest"] == first[name]["digest"] == late[name]["digest"], name
        assert late[name + "_after_kiln"]["digest"] == plain[name]["digest"], name
    # the kiln device trained after CUDA had run backward passes (losses and parameters vs eager CPU)
    assert late["kiln_after_cuda"]["close"], late["kiln_after_cuda"]
