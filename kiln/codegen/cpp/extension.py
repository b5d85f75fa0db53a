"""PyTorch C++ extensions Kiln builds once per machine and caches: the machinery they share.

An :class:`Extension` is one C++ source (with the local headers it includes, if any) built with ``torch.utils.cpp_extension`` the first time it
is needed, into ``config.launcher_dir/<prefix>_<key>.so`` (default ``~/.cache/kiln/launcher``,
``KILN_LAUNCHER_DIR``); the key covers the source and its headers, the torch and Python versions, the flags and
the compiler (``g++ --version``).  As for the kernel cache, the build runs under a per-key file
lock, lands by ``os.replace`` and has a ``.sha256`` sidecar that a later load checks.  A failure
(no compiler, a failed build, a bad file) is remembered for the process: ``load`` raises the
extension's ``unavailable`` error every time after that, without trying again.

Users: the native graph launcher (:mod:`kiln.codegen.cpp.launcher`), the native lazy recorder
(:mod:`kiln.frontends.lazy.native`) and the kiln device's C++ guard
(:mod:`kiln.frontends.lazy.device_guard`).  Where a caller can run without its extension,
:meth:`Extension.load_or_warn` gives None after one warning and one count per process.
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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from kiln import metrics
from kiln.codegen.cpp.build import BuildError, _toolchain_id, _valid, _write_atomic
from kiln.config import config

# (name, source, .so path) -> (module as loaded from the scratch build, seconds taken)
Builder = Callable[[str, str, Path], tuple[ModuleType, float]]


def extension_dir() -> Path:
    return Path(config.launcher_dir)


def key_of(source: str, cflags: list[str]) -> str:
    raw = "\n".join([source, torch.__version__, sys.version, " ".join(cflags), _toolchain_id()])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def build_so(
    name: str,
    source: str,
    so: Path,
    cflags: list[str],
    what: str,
    headers: dict[str, str] | None = None,
) -> tuple[ModuleType, float]:
    """Compile the extension in a scratch directory, then copy it into place: (the module as
    loaded from the scratch build, seconds taken).  ``headers`` (file name -> text) are written
    beside the source, where its ``#include "name"`` lines find them."""
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=so.parent, prefix=".build-") as tmp:
        src = Path(tmp) / f"{name}.cpp"
        src.write_text(source)
        for header, text in (headers or {}).items():
            (Path(tmp) / header).write_text(text)
        try:
            mod = cpp_extension.load(
                name,
                [str(src)],
                extra_cflags=cflags,
                build_directory=tmp,
                verbose=False,
                is_python_module=True,
            )
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            raise BuildError(f"building the {what} failed: {str(e)[-3000:]}") from None
        built = Path(tmp) / f"{name}.so"
        data = built.read_bytes()
    _write_atomic(so, data)
    _write_atomic(so.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
    return mod, time.perf_counter() - t0


class Extension:
    """One cached C++ extension: ``prefix`` names its files and metrics (``<prefix>_builds``,
    ``<prefix>_build_ms``), ``what`` names it in messages.  ``headers`` are local headers the
    source includes by file name (``#include "tensor.h"``): copied beside it for the build, and
    part of the cache key, so a change to any of them rebuilds."""

    def __init__(
        self,
        prefix: str,
        source: Path,
        cflags: list[str],
        what: str,
        headers: tuple[Path, ...] = (),
    ) -> None:
        self.prefix = prefix
        self.source = source
        self.headers = headers
        self.cflags = cflags
        self.what = what
        self.module: ModuleType | None = None
        self.error: str | None = None  # why the extension is unavailable in this process

    def build(self, name: str, source: str, so: Path) -> tuple[ModuleType, float]:
        return build_so(name, source, so, self.cflags, self.what, self.header_texts())

    def header_texts(self) -> dict[str, str]:
        return {h.name: h.read_text() for h in self.headers}

    def key_source(self) -> str:
        """The text the cache key covers: the source, then each header's name and text."""
        parts = [self.source.read_text()]
        for name, text in self.header_texts().items():
            parts += [f"// --- header {name}", text]
        return "\n".join(parts)

    def load(self, builder: Builder | None = None) -> ModuleType:
        """The module, built on first use; raises :class:`BuildError`, ``OSError`` or
        ``ImportError`` (the first time) or :class:`Unavailable` (after a failure)."""
        if self.module is not None:
            return self.module
        if self.error is not None:
            raise Unavailable(self.error)
        try:
            source = self.source.read_text()
            key_text = self.key_source() if self.headers else source
            name = f"{self.prefix}_{key_of(key_text, self.cflags)}"
            d = extension_dir()
            d.mkdir(parents=True, exist_ok=True)
            so = d / f"{name}.so"
            mod = None
            if not _valid(so):
                with FileLock(str(d / f"{name}.lock"), timeout=900):
                    if not _valid(so):
                        # a one-time wait of seconds to a minute: say what it is
                        print(
                            f"kiln: building the {self.what} (once per machine, cached in {d})",
                            file=sys.stderr,
                            flush=True,
                        )
                        mod, secs = (builder or self.build)(name, source, so)
                        metrics.incr(f"{self.prefix}_builds")
                        metrics.incr(f"{self.prefix}_build_ms", int(secs * 1000))
            if mod is None:
                mod = import_so(name, so)
        except (BuildError, OSError, ImportError) as e:
            self.error = str(e)
            raise
        self.module = mod
        return mod

    def load_or_warn(
        self, consequence: str, counter: str, builder: Builder | None = None
    ) -> ModuleType | None:
        """The module, or None where it cannot be built or loaded (the caller then runs without
        it).  The first failure in the process warns once (``RuntimeWarning``: "Kiln's <what> is
        unavailable (<error>); <consequence>", which should name what runs instead and the fix)
        and counts ``counter`` in ``metrics``; later calls return None without a word."""
        try:
            return self.load(builder)
        except Unavailable:
            return None
        except (BuildError, OSError, ImportError) as e:
            metrics.incr(counter)
            warnings.warn(self.unavailable(e, consequence), RuntimeWarning, stacklevel=3)
            return None

    def unavailable(self, error: object, consequence: str) -> str:
        """The message for a failed build or load: "Kiln's <what> is unavailable (<error>);
        <consequence>"."""
        return f"Kiln's {self.what} is unavailable ({error}); {consequence}"

    def forget(self) -> None:
        """Forget the loaded module and any earlier failure (tests use it)."""
        self.module = None
        self.error = None


class Unavailable(RuntimeError):
    """An extension whose build or load failed earlier in this process."""
