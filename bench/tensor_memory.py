"""Tensor memory at the allocator level: bytes live in PyTorch's CPU allocator, and their peak.

    from bench import tensor_memory as tm
    tm.install()                # once per process, before the tensors you want counted exist
    tm.reset_peak()             # peak := bytes live now
    step()
    print(tm.peak_bytes(), tm.live_bytes())

``install`` puts a counting wrapper in front of the CPU allocator (``c10::SetCPUAllocator``, a
small C++ extension, ``bench/tensor_memory.cpp``, built once per machine): every CPU tensor
allocated afterwards, from Python, ATen, oneDNN through ATen, Inductor's generated code or Kiln's
launcher and kernels' outputs, adds its requested size to a live counter when it is allocated and
subtracts it when its storage is freed.  Tensors that existed before ``install`` are not counted
(their storages keep their own allocator), nor is memory outside the allocator (Python objects,
code, oneDNN scratch buffers, malloc's own overhead): that is what process RSS shows besides.

The counting allocator hands each request to the allocator it replaced, so the memory itself and
its behaviour (alignment, huge pages, profiler reports) are unchanged.  It cannot be removed again:
use it in a process (or forked child) made for measuring.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kiln.codegen.cpp.build import BuildError
from kiln.codegen.cpp.extension import Extension
from kiln.codegen.cpp.extension import Unavailable as ExtensionUnavailable

# built once per machine into Kiln's extension folder (``KILN_LAUNCHER_DIR``), keyed on the source,
# torch, the flags and the compiler: a new virtual environment reuses it
_EXT = Extension(
    "kiln_bench_tensor_memory",
    Path(__file__).with_name("tensor_memory.cpp"),
    ["-O2"],
    "benchmark's counting CPU allocator",
)


class Unavailable(RuntimeError):
    """The counting allocator could not be built or installed (the reason is in the message)."""


def _ext() -> ModuleType:
    try:
        return _EXT.load()
    except (BuildError, OSError, ImportError, ExtensionUnavailable) as e:  # with what to do
        raise Unavailable(
            f"building the counting CPU allocator failed ({type(e).__name__}: "
            f"{str(e).strip()[:300]}); it needs g++ and ninja as torch.utils.cpp_extension does"
        ) from e


def load() -> None:
    """Build (first time on this machine) and load the extension without installing it."""
    _ext()


def install() -> None:
    """Count every CPU tensor allocated from now on (idempotent)."""
    m = _ext()
    m.install()
    if not m.active():
        raise Unavailable("another CPU allocator with a higher priority is installed")


def live_bytes() -> int:
    return int(_ext().live_bytes())


def peak_bytes() -> int:
    """The most bytes live at once since ``install`` or the last ``reset_peak``."""
    return int(_ext().peak_bytes())


def allocations() -> int:
    return int(_ext().allocations())


def reset_peak() -> None:
    _ext().reset_peak()


def active() -> bool:
    """Whether the counting allocator is the CPU allocator now."""
    return bool(_ext().active())
