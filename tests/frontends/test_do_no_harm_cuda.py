"""On a machine with CUDA: importing kiln leaves eager CUDA training bit-identical (plain,
activation checkpointing, bf16 autocast with checkpointing), whether kiln is imported first or
after CUDA training has run; asking for the kiln device afterwards warns (PyTorch then treats it
as the process's accelerator, which breaks CUDA backward passes, pytorch/pytorch#161129) and the
kiln device trains.  Skipped without CUDA; test_other_accelerator.py checks the same logic on any
machine by making PyTorch report an accelerator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _process_testlib import run_clean

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_SCRIPT = Path(__file__).with_name("cuda_programs.py")


def _run(*flags: str) -> dict[str, dict]:
    out = run_clean(str(_SCRIPT), *flags)
    return {r["program"]: r for r in map(json.loads, out.splitlines())}


def test_cuda_training_is_bit_identical_with_and_without_import_kiln():
    plain, first, late = _run(), _run("--kiln"), _run("--kiln-late")
    names = ("cuda_plain", "cuda_checkpoint", "cuda_autocast_checkpoint")
    for name in names:
        assert plain[name]["digest"] == first[name]["digest"] == late[name]["digest"], name
        assert late[name + "_after_import"]["digest"] == plain[name]["digest"], name
    # the kiln device, asked for after cuda backward passes ran: it warns, then trains like the CPU
    kiln_run = late["kiln_device"]
    assert kiln_run["warned"] and kiln_run["close"], kiln_run
