"""The native graph launcher extension: built once per machine, loaded lazily, cached.

``launcher.cpp`` (next to this file) interprets a compiled graph's program in one C++ call (see
:mod:`kiln.codegen.cpp.program`).  It is a PyTorch C++ extension built with
``torch.utils.cpp_extension`` the first time a graph needs it (~45 s on a 2-core machine), into
``config.launcher_dir/<name>.so`` (default ``~/.cache/kiln/launcher``, ``KILN_LAUNCHER_DIR``;
one build per machine, not per compile cache); the name covers the source, the torch and Python
versions, the flags and the compiler (``g++ --version``).  As for the kernel cache, the build runs under a per-key file lock,
lands by ``os.replace`` and has a ``.sha256`` sidecar that a later load checks.

Where no compiler works or the build fails, :func:`load` returns None once per process with a
warning naming the reason, ``metrics`` counts ``launcher_unavailable``, and every graph runs on the
Python executor (same results, more per-node overhead).  ``KILN_LAUNCHER=0`` chooses that path.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from kiln import metrics
from kiln.codegen.cpp.build import BuildError, _toolchain_id, _valid, _write_atomic
from kiln.config import config

SOURCE = Path(__file__).with_name("launcher.cpp")
CFLAGS = ["-O2", "-w"]


class LauncherUnavailable(RuntimeError):
    pass


_state: dict = {}  # "module": loaded module, or "error": why the launcher is unavailable


def _key(source: str) -> str:
    raw = "\n".join([source, torch.__version__, sys.version, " ".join(CFLAGS), _toolchain_id()])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _build(name: str, source: str, so: Path) -> tuple[ModuleType, float]:
    """Compile the extension in a scratch directory, then copy it into place: (the module as
    loaded from the scratch build, seconds taken)."""
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=so.parent, prefix=".build-") as tmp:
        src = Path(tmp) / f"{name}.cpp"
        src.write_text(source)
        try:
            mod = cpp_extension.load(
                name,
                [str(src)],
                extra_cflags=CFLAGS,
                build_directory=tmp,
                verbose=False,
                is_python_module=True,
            )
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            raise BuildError(
                f"building the native graph launcher failed: {str(e)[-3000:]}"
            ) from None
        built = Path(tmp) / f"{name}.so"
        data = built.read_bytes()
    _write_atomic(so, data)
    _write_atomic(so.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
    return mod, time.perf_counter() - t0


def load() -> ModuleType:
    """The launcher module, built on first use (raises :class:`LauncherUnavailable`)."""
    mod = _state.get("module")
    if mod is not None:
        return mod
    if "error" in _state:
        raise LauncherUnavailable(_state["error"])
    try:
        source = SOURCE.read_text()
        key = _key(source)
        name = f"kiln_launcher_{key}"
        d = launcher_dir()
        d.mkdir(parents=True, exist_ok=True)
        so = d / f"{name}.so"
        mod = None
        if not _valid(so):
            with FileLock(str(d / f"{name}.lock"), timeout=900):
                if not _valid(so):
                    mod, secs = _build(name, source, so)
                    metrics.incr("launcher_builds")
                    metrics.incr("launcher_build_ms", int(secs * 1000))
        if mod is None:
            mod = _import(name, so)
    except (BuildError, OSError, ImportError) as e:
        _state["error"] = str(e)
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
    _state["module"] = mod
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
    _state.clear()


def launcher_dir() -> Path:
    return Path(config.launcher_dir)
