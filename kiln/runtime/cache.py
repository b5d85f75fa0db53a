"""Compile cache: in memory, and persistent on disk.

Disk entries live under ``<cache_dir>/graphs/<key>.kgc``; the key covers the graph's structural hash,
Kiln's version, torch's version and the backend.  Writes go to a temporary file in the same folder
and are renamed into place (atomic on POSIX), under a file lock, so several processes can share one
cache.  Every entry carries a SHA-256 of its payload: a corrupt entry is reported once, removed,
and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

_MAGIC = b"KILNGC1\n"


class CorruptCacheEntry(RuntimeError):
    pass


class CacheDirError(RuntimeError):
    """The compile cache folder cannot hold files (a file in its place, no permission, ...)."""


_usable_dirs: set[str] = set()


def check_cache_dir(root: str) -> None:
    """Make sure ``root`` (``config.cache_dir``) is a folder Kiln can write, once per folder and
    process: compiled graphs, C++ kernels and AOTAutograd's entries all live there, so an unusable
    one fails at the first compile with what to change, not deep inside a cache read."""
    if root in _usable_dirs:
        return
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CacheDirError(
            f"Kiln's compile cache folder {root} cannot be used ({e}); Kiln keeps compiled "
            "graphs and C++ kernels there: set KILN_CACHE_DIR (kiln.config.cache_dir) to a "
            "writable folder"
        ) from e
    _usable_dirs.add(root)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Hash of the compiler's own source (passes, lowering, IR, code generator): a changed pass
    must not be served graphs that an older version of it optimized."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for sub in ("ir", "lowering", "passes", "codegen"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


# Read from the installed distribution: importing the ``kiln`` package from here would make the
# runtime import the frontends above it.
try:
    _KILN_VERSION = importlib.metadata.version("kiln")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    _KILN_VERSION = "source"


def kiln_version() -> str:
    return _KILN_VERSION


def cache_key(graph_hash: str, backend: str, options: str = "") -> str:
    """Key of a compiled graph: its structural hash, Kiln's and torch's versions, the compiler's
    code, the backend and the options that change what the pipeline produces."""
    raw = (
        f"{graph_hash}|kiln={_KILN_VERSION}|code={code_fingerprint()}"
        f"|torch={torch.__version__}|backend={backend}|options={options}"
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:40]


class MemoryCache:
    def __init__(self, capacity: int = 2048) -> None:
        self._d: OrderedDict[str, Any] = OrderedDict()
        self._cap = capacity
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._d[key] = value
            self._d.move_to_end(key)
            while len(self._d) > self._cap:
                self._d.popitem(last=False)

    def values(self) -> list[Any]:
        with self._lock:
            return list(self._d.values())

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


class DiskCache:
    """Checksummed entries under ``root/folder`` (``graphs``: optimized Kiln graphs), written
    atomically."""

    def __init__(self, root: str | os.PathLike, folder: str = "graphs") -> None:
        check_cache_dir(str(root))
        self.root = Path(root) / folder
        self._reported: set[str] = set()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.kgc"

    def lock(self, key: str) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / f"{key}.lock"), timeout=600)

    def load(self, key: str) -> Any | None:
        p = self.path(key)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return _decode(raw)
        except CorruptCacheEntry as e:
            if key not in self._reported:
                self._reported.add(key)
                warnings.warn(f"Kiln: corrupt cache entry {p} ({e}); removing it and rebuilding")
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            return None

    def store(self, key: str, value: Any) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        data = _encode(value)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


def _encode(value: Any) -> bytes:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(raw: bytes) -> Any:
    if not raw.startswith(_MAGIC) or len(raw) < len(_MAGIC) + 32:
        raise CorruptCacheEntry("bad header")
    digest = raw[len(_MAGIC) : len(_MAGIC) + 32]
    payload = raw[len(_MAGIC) + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCacheEntry("checksum mismatch")
    try:
        return pickle.loads(payload)
    except Exception as e:  # noqa: BLE001
        raise CorruptCacheEntry(f"cannot unpickle: {e}") from None
