"""The native graph launcher extension: built once per machine, loaded lazily, cached.

``launcher.cpp`` (next to this file) interprets a compiled graph's program in one C++ call (see
:mod:`kiln.codegen.cpp.program`).  It is a PyTorch C++ extension built with
``torch.utils.cpp_extension`` the first time a graph needs it (~45 s on a 2-core machine), into
``config.launcher_dir/<name>.so`` (default ``~/.cache/kiln/launcher``, ``KILN_LAUNCHER_DIR``;
one build per machine, not per compile cache); the name covers the source, the torch and Python
versions, the flags and the compiler (``g++ --version``); building, caching and loading are
:mod:`kiln.codegen.cpp.extension`'s (shared with the native lazy recorder).

Where no compiler works or the build fails, :func:`load` returns None once per process with a
warning naming the reason, ``metrics`` counts ``launcher_unavailable``, and every graph runs on the
Python executor (same results, more per-node overhead).  ``KILN_LAUNCHER=0`` chooses that path.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kiln.codegen.cpp.extension import Extension, extension_dir
from kiln.config import config
from kiln.ir import matmul_strided  # noqa: F401 - the op's schema, before the kernel registers

SOURCE = Path(__file__).with_name("launcher.cpp")
CFLAGS = ["-O2", "-w"]


class LauncherUnavailable(RuntimeError):
    pass


# the CPU kernel of kiln::matmul_strided, registered when the launcher loads (the op's schema
# and reference kernel: kiln.ir.matmul_strided, imported above so the schema comes first)
HEADERS = (Path(__file__).with_name("matmul_strided.h"),)
_EXT = Extension("kiln_launcher", SOURCE, CFLAGS, "native graph launcher", HEADERS)


def _build(name: str, source: str, so: Path) -> tuple[ModuleType, float]:
    """Compile the extension (tests replace this to simulate a machine without a compiler)."""
    return _EXT.build(name, source, so)


def load() -> ModuleType:
    """The launcher module, built on first use (raises :class:`LauncherUnavailable`; the first
    failure in the process warns once and counts ``launcher_unavailable``)."""
    mod = _EXT.load_or_warn(
        "compiled graphs run on the Python executor (correct, slower per node). It needs a "
        "working C++ compiler (g++) and PyTorch's headers; KILN_LAUNCHER=0 chooses the Python "
        "executor without this warning.",
        "launcher_unavailable",
        _build,
    )
    if mod is None:
        raise LauncherUnavailable(_EXT.error)
    return mod


def available() -> bool:
    """Whether graphs run on the native launcher (``config.launcher`` and a working build)."""
    if not config.launcher:
        return False
    try:
        load()
    except LauncherUnavailable:
        return False
    return True


def forget() -> None:
    """Forget the loaded module and any earlier failure (tests use it)."""
    _EXT.forget()


def launcher_dir() -> Path:
    return extension_dir()
