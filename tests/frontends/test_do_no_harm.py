"""Importing kiln leaves eager PyTorch untouched: the eager programs of eager_programs.py give
bit-identical results in a fresh process with and without ``import kiln``.

PyTorch's own Python test suite (test/test_utils.py, test/test_optim.py) does not ship in the
wheel (its torch/test holds C++ test binaries only), so the equivalent checks are here:
checkpointing (both implementations, checkpoint_sequential, under autocast), CPU autocast, module
conversions with tied weights and load_state_dict, every optimizer configuration of PyTorch's own
``optim_db`` for CPU with and without foreach, grad clipping, a transformers model with
``gradient_checkpointing_enable()``, and DataLoader workers with and without pinned memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _process_testlib import clean_env
from eager_programs import PROGRAMS

_SCRIPT = Path(__file__).with_name("eager_programs.py")


def _start(*flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(_SCRIPT), *flags],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _results(p: subprocess.Popen) -> dict[str, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-4000:]
    return {r["program"]: r["digest"] for r in map(json.loads, out.splitlines())}


def test_eager_programs_are_bit_identical_with_and_without_import_kiln():
    plain, with_kiln = _start(), _start("--kiln")  # side by side: two fresh processes
    a, b = _results(plain), _results(with_kiln)
    assert set(a) == set(b) == {*PROGRAMS, "gc_freeze_count"}
    differ = [name for name in a if a[name] != b[name]]
    assert not differ, f"results changed by import kiln: {differ}"
    assert a["gc_freeze_count"] == "0"
