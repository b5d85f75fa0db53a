"""glibc malloc thresholds at their ceilings, so a compiled step's large buffers stay mapped.

A compiled graph allocates its outputs and temporaries fresh on every run (PyTorch's CPU allocator
is glibc's ``malloc``) and frees them at their last use.  glibc serves a block above its mmap
threshold (128 KiB at start) with ``mmap`` and raises the threshold to the size of a freed mmapped
block (at most 32 MiB), with the trim threshold at twice that; whenever the free memory at the top
of the heap exceeds the trim threshold, it is returned to the kernel.  A step that frees a few
buffers of ~1 MB together (GPT-2's loss: logits, log-softmax, their gradients at 256 x 1000)
leaves more than the ~2 MB trim threshold free at the heap top, so the heap shrinks after every
step and the next step takes a page fault (and a zeroed page) on every 4 KiB it writes: 640 faults
per GPT-2 step here, ~1 ms of a ~12 ms step (``perf stat -e page-faults``).

:func:`tune_malloc` sets both thresholds at the first compile in the process: mmap at the ceiling
glibc's own adjustment would reach (32 MiB, the most ``mallopt`` takes), trim at 1 GiB.  Values
computed are unchanged; the process keeps up to 1 GiB of freed heap mapped instead of returning it
(between steps; the peak RSS is the step's own, which it already reached).  Until 2026-12-05 the
trim threshold was 64 MiB, twice the mmap threshold, as glibc pairs them: a 4-layer d=256 Llama
step (bench ``llama-large``) frees more than that at the heap top, so in a process of its own
compile mode took 14,650-14,900 minor page faults a step and ran 192-196 ms; with 256 MiB or 1 GiB,
32-138 faults and 152-174 ms (five processes, 2 threads, the same peak RSS, 650-656 MB).  A process
that ran eager steps first had kept its heap and hid it: 0 faults, 172 ms.  Not done when
``config.malloc_tuning`` is off (``KILN_MALLOC_TUNING=0``), when the C library is not glibc, when
the user set glibc's own malloc variables (``MALLOC_*_`` or a ``glibc.malloc`` tunable), or when
another allocator is preloaded (jemalloc, tcmalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import os

from kiln.config import config

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
# freed heap kept mapped at most: above a training step's own working set of freed buffers
# (llama-large frees more than 64 MiB at the top in each step; see the module docstring)
TRIM_THRESHOLD = 1 << 30

_USER_VARS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_ARENA_MAX",
)
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_state: dict[str, str] = {}  # "result": why it was or was not done (once per process)


def skip_reason(env: dict[str, str] | None = None) -> str:
    """Why the thresholds are left alone, or "" when :func:`tune_malloc` sets them."""
    env = dict(os.environ if env is None else env)
    if not config.malloc_tuning:
        return "off (KILN_MALLOC_TUNING=0)"
    set_by_user = [v for v in _USER_VARS if v in env]
    if set_by_user:
        return f"the user set {', '.join(set_by_user)}"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "the user set a glibc.malloc tunable (GLIBC_TUNABLES)"
    preload = env.get("LD_PRELOAD", "")
    if any(a in preload for a in _OTHER_ALLOCATORS):
        return f"another allocator is preloaded (LD_PRELOAD={preload})"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return "the C library is not glibc"
    return ""


def tune_malloc() -> str:
    """Set glibc's mmap and trim thresholds (see the module docstring), once per process.

    Returns "" when they were set (now or before), else why not."""
    if "result" in _state:
        return _state["result"]
    reason = skip_reason()
    if not reason:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
        if not ok:
            reason = "mallopt refused the thresholds"
    _state["result"] = reason
    return reason
