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

import warnings
from pathlib import Path
from types import ModuleType

from kiln import metrics
from kiln.codegen.cpp.build import BuildError
from kiln.codegen.cpp.extension import Extension, Unavailable, extension_dir
from kiln.config import config

SOURCE = Path(__file__).with_name("launcher.cpp")
CFLAGS = ["-O2", "-w"]


class LauncherUnavailable(RuntimeError):
    pass


_EXT = Extension("kiln_launcher", SOURCE, CFLAGS, "native graph launcher")


def _build(name: str, source: str, so: Path) -> tuple[ModuleType, float]:
    """Compile the extension (tests replace this to simulate a machine without a compiler)."""
    return _EXT.build(name, source, so)


def load() -> ModuleType:
    """The launcher module, built on first use (raises :class:`LauncherUnavailable`)."""
    try:
        return _EXT.load(_build)
    except Unavailable as e:
        raise LauncherUnavailable(str(e)) from None
    except (BuildError, OSError, ImportError) as e:
        metrics.incr("launcher_unavailable")
        warnings.warn(
            f"Kiln's native graph launcher is unavailable ({e}); compiled graphs run on the "
            "Python executor (correct, slower per node). It needs a working C++ compiler (g++) "
            "and PyTorch's headers; KILN_LAUNCHER=0 chooses the Python executor without this "
            "warning.",
            RuntimeWarning,
            stacklevel=2,
        )
        raise LauncherUnavailable(str(e)) from None


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
