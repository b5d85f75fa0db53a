"""The kiln device's guard in C++, for every process that uses the device.

PyTorch's Python device guard (what ``torch._C._acc`` offers a Python backend) asks Python for the
device type inside ``noexcept`` functions; when a backward hook raises on a kiln tensor, the
autograd engine unwinds with the Python error pending, that call fails and the process aborts
(SIGABRT, "terminate called without an active exception") instead of raising the hook's error
from ``backward()``.  ``guard.h`` is the same guard in C++; ``guard.cpp`` makes it a tiny
extension (~1.5 s to build, once per machine, cached beside the launcher by
:mod:`kiln.codegen.cpp.extension`) that :func:`install` loads at the device's first use.

The same extension gives the device its c10 allocator (``allocator.h``): PyTorch allocates
through it for ``torch.UntypedStorage(n, device="kiln")`` (without one the process died in
c10) and asks it for ``torch.accelerator``'s memory API, which it answers from Kiln's memory
statistics (:mod:`kiln.frontends.lazy.memory`).

The same extension tells profiler sessions apart for the lazy device's ``kiln::record`` range,
which begins in one call and ends in a later one (``metrics.open_span``): ended after its session
stopped, it wrote into that session's freed records and a later GC crashed.

Where it cannot be built (no compiler), the Python guard stays: everything works except that a
raising backward hook on a kiln tensor ends the process; one ``RuntimeWarning`` says so and
``metrics`` counts ``device_guard_unavailable``.  The native recorder carries the same guard in
its own extension and installs it when it loads.
"""

from __future__ import annotations

from pathlib import Path

from kiln import metrics
from kiln.codegen.cpp.extension import Extension
from kiln.frontends.lazy import memory

_HERE = Path(__file__).parent
_EXT = Extension(
    "kiln_device_guard",
    _HERE / "guard.cpp",
    ["-O2", "-w"],
    "C++ device guard",
    headers=(_HERE / "guard.h", _HERE / "allocator.h"),
)


def install() -> bool:
    """Make the C++ guard the kiln device's guard; whether it is (False: the Python guard stays,
    with one warning per process)."""
    mod = _EXT.load_or_warn(
        "the kiln device uses PyTorch's Python device guard, with which an exception raised in a "
        "backward hook on a kiln tensor ends the process (SIGABRT) instead of reaching "
        "backward(). It needs a working C++ compiler (g++) and PyTorch's headers.",
        "device_guard_unavailable",
    )
    if mod is None:
        return False
    mod.install_device_guard()
    mod.install_allocator(_memory_stats, memory.reset_peak)
    metrics.profiler_sessions = (mod.profiler_session, mod.same_profiler_session)
    return True


def _memory_stats() -> tuple[int, int]:
    """The bytes the kiln device's live tensors hold now and at their peak (``torch.kiln``'s
    ``memory_allocated`` and ``max_memory_allocated``), for ``torch.accelerator``'s memory API."""
    memory.update_peak()
    return memory._allocated(), memory.peak()


def installed() -> bool:
    """Whether this extension's guard is the kiln device's guard now."""
    return _EXT.module is not None and bool(_EXT.module.device_guard_installed())
