"""glibc malloc thresholds (kiln/runtime/malloc.py): set at the first compile unless switched off
or overridden by the user, and what they are for: freed ~1 MB buffers stay mapped, so the next
step's buffers take no page faults (checked through the free memory glibc keeps at the heap
top, not by timing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kiln.config import config
from kiln.runtime import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Four blocks of MIB MiB written and freed together (as a step frees its large buffers), then how
# much free memory glibc keeps at the top of the heap (mallinfo2().keepcost, MiB) in each of five
# rounds.  Untuned (at most ~2 * the largest freed mmapped block, here 0) the top is trimmed back
# to the kernel, and the next round faults every page in again; tuned (1 GiB) it stays.
_CHILD = textwrap.dedent(
    """
    import ctypes, sys
    import torch
    from kiln.runtime.malloc import tune_malloc
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    f = torch.compile(lambda x: x * 2 + 1, backend="kiln")  # the first compile tunes
    f(torch.randn(8))
    print(repr(tune_malloc()))
    kept = []
    mib = int(sys.argv[1])
    for _ in range(5):
        blocks = [libc.malloc(mib << 20) for _ in range(4)]
        for b in blocks:
            ctypes.memset(b, 1, mib << 20)
        for b in blocks:
            libc.free(b)
        kept.append(libc.mallinfo2().keepcost >> 20)
    print(min(kept))
    """
)


def _child(tuning: str, mib: int = 3) -> tuple[str, int]:
    """(tune_malloc()'s result, the least free memory (MiB) kept at the heap top over the rounds
    of freeing four blocks of ``mib`` MiB)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    env.update(KILN_MALLOC_TUNING=tuning, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(mib)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    return lines[-2], int(lines[-1])


def _glibc() -> bool:
    saved = config.malloc_tuning
    try:
        config.update(malloc_tuning=True)
        return malloc.skip_reason({}) == ""
    finally:
        config.update(malloc_tuning=saved)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc thresholds only")
def test_first_compile_keeps_freed_blocks_mapped() -> None:
    """After a Kiln compile, 12 MiB freed at the heap top stay mapped (the next step's buffers
    take no page faults); with KILN_MALLOC_TUNING=0 glibc's defaults return them."""
    reason, kept = _child("1")
    assert reason == "''" and kept >= 12, (reason, kept)
    reason, kept = _child("0")
    assert "KILN_MALLOC_TUNING=0" in reason and kept < 12, (reason, kept)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc thresholds only")
def test_a_step_that_frees_more_than_64_mib_keeps_it_mapped() -> None:
    """Four 24 MiB buffers (each below the 32 MiB mmap threshold, so on the heap) freed together:
    96 MiB at the heap top, more than the 64 MiB trim threshold Kiln set before 2026-12-05 (a
    4-layer Llama step took ~14,700 page faults through it); they stay mapped."""
    reason, kept = _child("1", mib=24)
    assert reason == "''" and kept >= 96, (reason, kept)


def test_skip_reasons() -> None:
    saved = config.malloc_tuning
    try:
        config.update(malloc_tuning=False)
        assert "KILN_MALLOC_TUNING=0" in malloc.skip_reason({})
        config.update(malloc_tuning=True)
        assert "MALLOC_TRIM_THRESHOLD_" in malloc.skip_reason({"MALLOC_TRIM_THRESHOLD_": "1"})
        tunable = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}
        assert "GLIBC_TUNABLES" in malloc.skip_reason(tunable)
        preload = {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}
        assert "preloaded" in malloc.skip_reason(preload)
    finally:
        config.update(malloc_tuning=saved)


def test_config_key_is_typed() -> None:
    with pytest.raises(ValueError, match="must be True or False"):
        config.update(malloc_tuning="yes")
