"""torch's source key for AOTAutograd's cache, remembered across processes.

AOTAutograd's cache key includes ``torch._inductor.codecache.torch_key()``: a SHA-256 over the
contents of every module file of the installed torch (~2,300 files read and hashed), computed
once per process, 0.08-0.12 s of a warm start's first step on this machine.  Kiln keeps the
value in its cache folder beside a fingerprint of those files (relative path, size and
modification time of every ``.py`` and extension module under torch's folder, torch's version,
the interpreter's version; one ``scandir`` walk, ~0.02 s), and a later process whose
fingerprint matches hands the value to torch (``torch_key.set``: the hook torch's
``prefetchable_cache`` offers for this) instead of hashing the files again.

Needs: ``config.disk_cache`` on.  Guarantees: the value torch uses is the one torch computed
for files with the same paths, sizes and modification times (any reinstall, upgrade or edit of
torch changes the fingerprint, and the key is computed and stored again); a missing, damaged or
foreign memo file is ignored and rewritten; a key torch already has in this process is kept.
The memo is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch._inductor.codecache as _codecache

from kiln import metrics
from kiln.codegen.cpp.build import _write_atomic
from kiln.config import config

_MEMO_NAME = "torch_key.json"
# the files torch_key() reads: module files found by pkgutil (sources and extension modules),
# and two of Inductor's (codegen/aoti_runtime/interface.cpp, script.ld)
_SUFFIXES = (".py", ".so", ".pyd", ".cpp", ".ld")

_lock = threading.Lock()
_primed = False


def fingerprint(root: str | os.PathLike) -> str:
    """Paths (relative to ``root``), sizes and modification times of the files under ``root``
    that torch's key reads, with torch's and Python's versions: a hex SHA-256."""
    root = os.fspath(root)
    h = hashlib.sha256(f"{torch.__version__}|{sys.version}|{root}\n".encode())
    stack = [root]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if e.name != "__pycache__":
                    stack.append(e.path)
            elif e.name.endswith(_SUFFIXES):
                st = e.stat()
                rel = os.path.relpath(e.path, root)
                h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def memo_path() -> Path:
    return Path(config.cache_dir) / _MEMO_NAME


def _read_memo(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if not isinstance(data.get("fingerprint"), str) or not isinstance(data.get("key"), str):
        return None
    return data


def _write_memo(path: Path, fp: str, key: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps({"fingerprint": fp, "key": key.hex()}).encode())


def _torch_root() -> str:
    return os.path.dirname(os.path.abspath(torch.__file__))


def prime() -> None:
    """Once per process, before AOTAutograd's first cache lookup: give torch its key from the
    memo (counted ``torch_key_memo_hits``), or compute it and store it (``torch_key_memo_misses``).
    Nothing happens with the disk cache off."""
    global _primed
    with _lock:
        if _primed or not config.disk_cache:
            return
        _primed = True
        path = memo_path()
        fp = fingerprint(_torch_root())
        memo = _read_memo(path)
        if memo is not None and memo["fingerprint"] == fp:
            try:
                key = bytes.fromhex(memo["key"])
            except ValueError:
                key = b""
            if len(key) == hashlib.sha256().digest_size:
                try:
                    _codecache.torch_key.set(key)
                except RuntimeError:  # torch computed its key already in this process: keep it
                    pass
                metrics.incr("torch_key_memo_hits")
                return
        key = _codecache.torch_key()
        metrics.incr("torch_key_memo_misses")
        try:
            _write_memo(path, fp, key)
        except OSError:  # a read-only cache folder: the next process computes the key again
            pass


def reset() -> None:
    """Forget that this process primed torch's key (tests)."""
    global _primed
    with _lock:
        _primed = False
