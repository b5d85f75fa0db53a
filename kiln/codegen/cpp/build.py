"""Compile generated C++ with the system g++ and load it with ctypes, through a build cache.

Cache entries live under ``<config.cache_dir>/kernels/<key>.so``; the key covers the source, the
flags, the compiler version (``g++ --version``) and the CPU's feature flags, never concrete tensor
sizes (kernels take sizes as arguments).  Each ``.so`` has a ``.sha256`` sidecar: an entry whose
bytes do not match it (a torn or corrupted file) is rebuilt.  Builds run under a per-key file lock
and land by ``os.replace`` of a temporary file, so processes can share one cache.  Several
translation units are compiled in parallel (one g++ process each).

Kernel level (:func:`build_kernels`): a unit holds several kernels, and a kernel is found again
wherever it was built before, whatever unit held it.  ``<cache_dir>/kernels/index/<kernel key>``
(the key covers the kernel's source, the prelude, the flags and the toolchain, as above) names the
unit that holds it, written atomically once the unit has landed; a kernel whose unit is listed and
valid is loaded from that unit, and only the kernels found nowhere go into a new unit.  A graph
that repeats kernels of earlier graphs (a new shape, another chunk of a test sweep, the lazy
device's next step) then compiles only what is new.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from filelock import FileLock

from kiln import metrics
from kiln.config import config

# -O2: half the compile time of -O3 on generated units; the omp simd pragmas still vectorize.
FLAGS = [
    "-O2",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    # no a*b+c -> fma contraction: ATen rounds each op, so a fused chain of +, -, * gives
    # eager's bits (contracted, 1 - x*x near x=1 differed from eager by 1e-5 relative)
    "-ffp-contract=off",
    "-std=c++17",
    "-w",
]
LIBS = ["-lmvec"]  # glibc's vector math (the prelude declares its SIMD variants); after the source
CXX = os.environ.get("CXX", "g++")

_loaded: dict[str, ctypes.CDLL] = {}
_units_of: dict[str, str] = {}  # kernel key -> key of a unit holding it (this process)


class BuildError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def _toolchain_id() -> str:
    try:
        ver = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"no working C++ compiler ({CXX}): {e}") from None
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                cpu = line
                break
    except OSError:
        pass
    return hashlib.sha256((ver + "|" + cpu).encode()).hexdigest()


def cache_key(source: str) -> str:
    raw = "\n".join([source, " ".join(FLAGS + LIBS), _toolchain_id()])
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def kernel_dir() -> Path:
    d = Path(config.cache_dir) / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _valid(so: Path) -> bool:
    side = so.with_suffix(".sha256")
    try:
        want = side.read_text().strip()
        have = hashlib.sha256(so.read_bytes()).hexdigest()
    except OSError:
        return False
    return want == have


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _start_compile(source: str, key: str, d: Path) -> tuple[subprocess.Popen, Path, Path]:
    cpp = d / f".{key}.{os.getpid()}.cpp"
    cpp.write_text(source)
    tmp_so = d / f".{key}.{os.getpid()}.so.tmp"
    proc = subprocess.Popen(
        [CXX, *FLAGS, str(cpp), *LIBS, "-o", str(tmp_so)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, cpp, tmp_so


def build_many(sources: list[str]) -> list[ctypes.CDLL]:
    """Compile (or fetch from the cache) each translation unit, in parallel; load them all."""
    d = kernel_dir()
    keys = [cache_key(s) for s in sources]
    libs: list[ctypes.CDLL | None] = [_loaded.get(k) for k in keys]
    pending = []
    locks = []
    try:
        for idx, (src, key) in enumerate(zip(sources, keys)):
            if libs[idx] is not None:
                continue
            so = d / f"{key}.so"
            if _valid(so):
                metrics.incr("kernel_cache_hits")
                continue
            lock = FileLock(str(d / f"{key}.lock"), timeout=600)
            lock.acquire()
            locks.append(lock)
            if _valid(so):  # built by another process while we waited
                metrics.incr("kernel_cache_hits")
                continue
            pending.append((key, so, *_start_compile(src, key, d)))
        for key, so, proc, cpp, tmp_so in pending:
            _, err = proc.communicate()
            try:
                if proc.returncode != 0:
                    raise BuildError(f"g++ failed for kernel unit {key}:\n{err[-4000:]}")
                data = tmp_so.read_bytes()
                _write_atomic(so, data)
                _write_atomic(so.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
                metrics.incr("kernel_builds")
            finally:
                for p in (cpp, tmp_so):
                    if p.exists():
                        p.unlink()
    finally:
        for lock in locks:
            lock.release()
    out = []
    for idx, key in enumerate(keys):
        lib = libs[idx]
        if lib is None:
            lib = ctypes.CDLL(str(d / f"{key}.so"))
            _loaded[key] = lib
        out.append(lib)
    return out


def kernel_key(prelude: str, source: str) -> str:
    """A kernel's key in the index: its source, the prelude it is compiled after, flags, toolchain."""
    return cache_key(_sha(prelude) + "\n" + source)


@lru_cache(maxsize=8)
def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _index_dir() -> Path:
    d = kernel_dir() / "index"
    d.mkdir(exist_ok=True)
    return d


def _from_index(kkey: str, symbols: tuple[str, ...], d: Path) -> tuple[ctypes.CDLL, str] | None:
    """(library, unit key) of a unit that already holds the kernel with these symbols, or None."""
    ukey = _units_of.get(kkey)
    if ukey is None:
        try:
            ukey = (_index_dir() / kkey).read_text().strip()
        except OSError:
            return None
    lib = _loaded.get(ukey)
    if lib is None:
        so = d / f"{ukey}.so"
        if len(ukey) != 32 or not _valid(so):  # unknown, removed or corrupted: built anew
            return None
        lib = ctypes.CDLL(str(so))
        _loaded[ukey] = lib
        metrics.incr("kernel_cache_hits")
    if not all(hasattr(lib, name) for name in symbols):
        return None
    _units_of[kkey] = ukey
    return lib, ukey


def build_kernels(
    kernels: dict[str, tuple[str, tuple[str, ...]]], prelude: str, split_at: int
) -> dict[str, ctypes.CDLL]:
    """The library holding each kernel: ``kernels`` maps an id to (C++ source, symbols it
    defines), each compiled after ``prelude``.  A kernel some unit already holds (this process,
    or the on-disk index) comes from that unit; the others are compiled into new units, sorted by
    id (more than ``split_at``: two units, two g++ in parallel), and listed in the index."""
    d = kernel_dir()
    keys = {k: kernel_key(prelude, src) for k, (src, _) in kernels.items()}
    out: dict[str, ctypes.CDLL] = {}
    new: list[str] = []
    for k in sorted(kernels):
        found = _from_index(keys[k], kernels[k][1], d)
        if found is None:
            new.append(k)
        else:
            out[k] = found[0]
            metrics.incr("kernels_reused")
    if not new:
        return out
    units = [new] if len(new) <= split_at else [new[: len(new) // 2], new[len(new) // 2 :]]
    sources = [prelude + "\n".join(kernels[k][0] for k in u) for u in units]
    libs = build_many(sources)
    index = _index_dir()
    for u, src, lib in zip(units, sources, libs):
        ukey = cache_key(src)
        for k in u:
            out[k] = lib
            if _units_of.get(keys[k]) != ukey:
                _write_atomic(index / keys[k], ukey.encode())
                _units_of[keys[k]] = ukey
    return out


def forget_loaded() -> None:
    """Drop the in-process tables of loaded libraries and of the units holding each kernel
    (tests use it to force a lookup in the on-disk cache)."""
    _loaded.clear()
    _units_of.clear()
