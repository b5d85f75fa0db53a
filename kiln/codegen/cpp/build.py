"""Compile generated C++ with the system g++ and load it with ctypes, through a build cache.

Cache entries live under ``<config.cache_dir>/kernels/<key>.so``; the key covers the source, the
flags, the compiler version (``g++ --version``) and the CPU's feature flags, never concrete tensor
sizes (kernels take sizes as arguments).  Each ``.so`` has a ``.sha256`` sidecar: an entry whose
bytes do not match it (a torn or corrupted file) is rebuilt.  Builds run under a per-key file lock
and land by ``os.replace`` of a temporary file, so processes can share one cache.  Several
translation units are compiled in parallel (one g++ process each), in the background
(:func:`start_many`, :func:`start_kernels`): the caller goes on (PyTorch traces the next graph)
and waits at first use; at most :data:`MAX_INFLIGHT` g++ run at once, the next build lands the
previous one first.  A cache hit starts no process and waits for nothing.

Kernel level (:func:`build_kernels`): a unit holds several kernels, and a kernel is found again
wherever it was built before, whatever unit held it.  ``<cache_dir>/kernels/index/<kernel key>``
(the key covers the kernel's source, the prelude, the flags and the toolchain, as above) names the
unit that holds it, written atomically once the unit has landed; a kernel whose unit is listed and
valid is loaded from that unit, and only the kernels found nowhere go into a new unit.  A graph
that repeats kernels of earlier graphs (a new shape, another chunk of a test sweep, the lazy
device's next step) then compiles only what is new.
"""

from __future__ import annotations

import atexit
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


MAX_INFLIGHT = 2  # g++ processes running in the background at once (the machine's cores)
_inflight: list[PendingUnits] = []  # started, not yet waited for (oldest first)


class PendingUnits:
    """Translation units whose g++ runs in the background (:func:`start_many`).  :meth:`wait`
    waits for g++, lands each ``.so`` in the cache (atomically, under the unit's file lock, held
    since the start), then loads the libraries; a failed g++ raises :class:`BuildError`, at
    every call.  With nothing to compile (all cache hits) it is done at once: no process."""

    def __init__(self, d: Path, keys: list[str], jobs: list, locks: list[FileLock]) -> None:
        self._d, self._keys, self._jobs, self._locks = d, keys, jobs, locks
        self._libs: list[ctypes.CDLL] | None = None
        self._error: BuildError | None = None
        if jobs:
            _inflight.append(self)

    @property
    def running(self) -> bool:
        """Whether g++ processes were started and not yet waited for."""
        return bool(self._jobs)

    def wait(self) -> list[ctypes.CDLL]:
        if self._error is not None:
            raise self._error
        if self._libs is None:
            try:
                self._land()
            except BuildError as e:
                self._error = e
                raise
            self._libs = [self._load(key) for key in self._keys]
        return self._libs

    def _load(self, key: str) -> ctypes.CDLL:
        lib = _loaded.get(key)
        if lib is None:
            lib = ctypes.CDLL(str(self._d / f"{key}.so"))
            _loaded[key] = lib
        return lib

    def _land(self) -> None:
        jobs, self._jobs = self._jobs, []
        if self in _inflight:
            _inflight.remove(self)
        try:
            for n, (key, so, proc, cpp, tmp_so) in enumerate(jobs):
                try:
                    _, err = proc.communicate()
                    if proc.returncode != 0:
                        raise BuildError(f"g++ failed for kernel unit {key}:\n{err[-4000:]}")
                    data = tmp_so.read_bytes()
                    _write_atomic(so, data)
                    _write_atomic(
                        so.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode()
                    )
                    metrics.incr("kernel_builds")
                except BaseException:
                    _abandon(jobs[n + 1 :])
                    raise
                finally:
                    _unlink(cpp, tmp_so)
        finally:
            for lock in self._locks:
                lock.release()
            self._locks = []

    def abandon(self) -> None:
        """Stop the g++ processes, remove their files, release the locks (at exit, unwaited)."""
        jobs, self._jobs = self._jobs, []
        _abandon(jobs)
        for lock in self._locks:
            lock.release()
        self._locks = []


def _unlink(*paths: Path) -> None:
    for p in paths:
        if p.exists():
            p.unlink()


def _abandon(jobs: list) -> None:
    for _, _, proc, cpp, tmp_so in jobs:
        proc.kill()
        proc.communicate()
        _unlink(cpp, tmp_so)


@atexit.register
def _abandon_inflight() -> None:
    while _inflight:
        _inflight.pop().abandon()


def _make_room(n: int) -> None:
    """Wait for the oldest background builds until ``n`` more g++ fit in :data:`MAX_INFLIGHT`
    (their errors are raised by their own :meth:`PendingUnits.wait`, not here)."""
    while _inflight and sum(len(p._jobs) for p in _inflight) + n > MAX_INFLIGHT:
        try:
            _inflight[0].wait()
        except BuildError:
            pass  # kept in the PendingUnits: its graph's first run raises it


def start_many(sources: list[str]) -> PendingUnits:
    """Start g++ for each translation unit not in the cache (one process each, in parallel) and
    return without waiting: :meth:`PendingUnits.wait` gives the loaded libraries."""
    d = kernel_dir()
    keys = [cache_key(s) for s in sources]
    if _inflight and any(k not in _loaded for k in keys):
        # this process's own background builds hold their units' locks: land them first (a unit
        # of theirs asked again is then a cache hit, never a lock held against ourselves)
        _make_room(MAX_INFLIGHT)
    jobs = []
    locks = []
    try:
        for src, key in zip(sources, keys):
            if key in _loaded:
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
            jobs.append((key, so, *_start_compile(src, key, d)))
    except BaseException:
        _abandon(jobs)
        for lock in locks:
            lock.release()
        raise
    return PendingUnits(d, keys, jobs, locks)


def build_many(sources: list[str]) -> list[ctypes.CDLL]:
    """Compile (or fetch from the cache) each translation unit, in parallel; load them all."""
    return start_many(sources).wait()


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


class PendingKernels:
    """The libraries of a set of kernels, some maybe still compiling (:func:`start_kernels`):
    :meth:`wait` gives ``{kernel id: library}`` and lists the new units in the index."""

    def __init__(
        self, found: dict[str, ctypes.CDLL], units: list[list[str]], keys: dict, sources: list
    ) -> None:
        self._out = found
        self._units, self._keys, self._sources = units, keys, sources
        self._pending = start_many(sources) if sources else None
        self.n_units = len({id(lib) for lib in found.values()}) + len(set(map(cache_key, sources)))

    @property
    def running(self) -> bool:
        return self._pending is not None and self._pending.running

    def wait(self) -> dict[str, ctypes.CDLL]:
        if self._pending is None:
            return self._out
        libs = self._pending.wait()
        index = _index_dir()
        for u, src, lib in zip(self._units, self._sources, libs):
            ukey = cache_key(src)
            for k in u:
                self._out[k] = lib
                if _units_of.get(self._keys[k]) != ukey:
                    _write_atomic(index / self._keys[k], ukey.encode())
                    _units_of[self._keys[k]] = ukey
        self._pending = None
        return self._out


def start_kernels(
    kernels: dict[str, tuple[str, tuple[str, ...]]], prelude: str, split_at: int
) -> PendingKernels:
    """The library holding each kernel, as :class:`PendingKernels`: ``kernels`` maps an id to
    (C++ source, symbols it defines), each compiled after ``prelude``.  A kernel some unit
    already holds (this process, or the on-disk index) comes from that unit; the others are
    compiled into new units, sorted by id (more than ``split_at``: two units, two g++ in
    parallel), in the background, and listed in the index once built."""
    d = kernel_dir()
    keys = {k: kernel_key(prelude, src) for k, (src, _) in kernels.items()}
    found: dict[str, ctypes.CDLL] = {}
    new: list[str] = []
    for k in sorted(kernels):
        hit = _from_index(keys[k], kernels[k][1], d)
        if hit is None:
            new.append(k)
        else:
            found[k] = hit[0]
            metrics.incr("kernels_reused")
    if not new:
        return PendingKernels(found, [], keys, [])
    units = [new] if len(new) <= split_at else [new[: len(new) // 2], new[len(new) // 2 :]]
    sources = [prelude + "\n".join(kernels[k][0] for k in u) for u in units]
    return PendingKernels(found, units, keys, sources)


def build_kernels(
    kernels: dict[str, tuple[str, tuple[str, ...]]], prelude: str, split_at: int
) -> dict[str, ctypes.CDLL]:
    """:func:`start_kernels`, waited for."""
    return start_kernels(kernels, prelude, split_at).wait()


def forget_loaded() -> None:
    """Drop the in-process tables of loaded libraries and of the units holding each kernel
    (tests use it to force a lookup in the on-disk cache)."""
    _loaded.clear()
    _units_of.clear()
