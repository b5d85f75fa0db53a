"""Compile generated C++ with the system g++ and load it with ctypes, through a build cache.

Cache entries live under ``<config.cache_dir>/kernels/<key>.so``; the key covers the source, the
flags, the compiler version (``g++ --version``) and the CPU's feature flags, never concrete tensor
sizes (kernels take sizes as arguments).  Each ``.so`` has a ``.sha256`` sidecar: an entry whose
bytes do not match it (a torn or corrupted file) is rebuilt.  A unit's build runs start to end
in a build thread (at most ``MAX_JOBS`` g++ at a time) under the unit's file lock: the lock is
taken before g++ starts and released as soon as the ``.so`` has landed (by ``os.replace`` of a
temporary file), never held while anything else waits, so processes (ranks of one job) can share
one cache.  The caller gets a :class:`PendingUnit` at once and goes on; :meth:`PendingUnit.wait`
(a graph's first run) loads the unit.  A forked child builds what its parent's threads had in
flight itself (the threads stayed in the parent).

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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
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
MAX_JOBS = 2  # g++ processes at a time (the build threads)

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


def _spawn_and_wait(argv: list[str], log_fd: int) -> int:
    """Run ``argv`` (looked up on PATH) with stdout and stderr to ``log_fd``; its exit code.

    ``os.posix_spawnp``, not ``subprocess``: ``subprocess`` starts a child through a pipe that
    reports a failed ``exec`` and reads it to its end, and a process forked by another thread
    in that window (a DataLoader worker forked while a build thread starts g++) keeps the pipe's
    write end open, so the build thread waited for that child to exit -- and the child, waiting
    for the build's lock, never did (a deadlock seen in 9 of 30 stress runs).  ``posix_spawnp``
    opens no descriptor in this process."""
    pid = os.posix_spawnp(
        argv[0],
        argv,
        os.environ,
        file_actions=[
            (os.POSIX_SPAWN_DUP2, log_fd, 1),
            (os.POSIX_SPAWN_DUP2, log_fd, 2),
        ],
    )
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _compile(source: str, key: str, d: Path) -> bytes:
    """Run g++ on one unit in the caller's thread (the GIL is free while it runs); the .so bytes."""
    cpp = d / f".{key}.{os.getpid()}.{threading.get_ident()}.cpp"
    tmp_so = cpp.with_suffix(".so.tmp")
    try:
        cpp.write_text(source)
        # g++'s output goes to a file, not a pipe: a process forked by another thread while g++
        # runs inherits a pipe's write end, and reading the pipe to its end would then wait for
        # that child to exit (a forked child that waits for this build's lock never does)
        with tempfile.TemporaryFile(mode="w+") as log:
            code = _spawn_and_wait([CXX, *FLAGS, str(cpp), *LIBS, "-o", str(tmp_so)], log.fileno())
            if code != 0:
                log.seek(0)
                raise BuildError(f"g++ failed for kernel unit {key}:\n{log.read()[-4000:]}")
        return tmp_so.read_bytes()
    finally:
        for f in (cpp, tmp_so):
            if f.exists():
                f.unlink()


def _build_unit(source: str, key: str, d: Path, index: tuple[str, ...]) -> Path:
    """One unit's whole build, start to end: under its file lock, compile it (unless another
    process has meanwhile), land the .so and its checksum atomically, release the lock; then list
    the unit in the kernel index under ``index`` (the keys of the kernels it holds).  Nothing here
    waits for anything but g++ and the lock, so a build never holds the lock longer than g++
    runs (processes sharing a cache, ranks of one job, only ever wait for each other's g++)."""
    so = d / f"{key}.so"
    if _valid(so):
        metrics.incr("kernel_cache_hits")
    else:
        with FileLock(str(d / f"{key}.lock"), timeout=600):
            if _valid(so):  # built by another process while we waited
                metrics.incr("kernel_cache_hits")
            else:
                data = _compile(source, key, d)
                _write_atomic(so, data)
                _write_atomic(so.with_suffix(".sha256"), hashlib.sha256(data).hexdigest().encode())
                metrics.incr("kernel_builds")
    if index:
        idx = d / "index"
        idx.mkdir(exist_ok=True)
        for kkey in index:
            _write_atomic(idx / kkey, key.encode())
    return so


_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


_in_flight: set[Future] = set()  # builds submitted and not yet done (this process)


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until no build thread of this process has a unit to build (background builds the
    compile path started); False if some are still running after ``timeout`` seconds."""
    _, not_done = wait_futures(list(_in_flight), timeout=timeout)
    return not not_done


def _workers() -> ThreadPoolExecutor:
    """The build threads of this process (a forked child makes its own: its parent's are not
    in it)."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(max_workers=MAX_JOBS, thread_name_prefix="kiln-g++")
        _pool_pid = os.getpid()
    return _pool


class PendingUnit:
    """A unit being built by a build thread (:func:`_build_unit`); :meth:`wait` loads it."""

    def __init__(self, source: str, key: str, d: Path, index: tuple[str, ...] = ()) -> None:
        self.key = key
        self._args = (source, key, d, index)
        self._pid = os.getpid()
        self._future: Future = _workers().submit(_build_unit, *self._args)
        _in_flight.add(self._future)
        self._future.add_done_callback(_in_flight.discard)

    @property
    def running(self) -> bool:
        return not self._future.done()

    @property
    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    def wait(self) -> ctypes.CDLL:
        """The loaded unit, once built (a failed g++ raises its BuildError here, every time)."""
        lib = _loaded.get(self.key)
        if lib is not None:
            return lib
        if self._pid != os.getpid():  # a forked child: the build thread stayed in the parent
            so = _build_unit(*self._args)
        else:
            so = self._future.result()
        lib = _loaded[self.key] = ctypes.CDLL(str(so))
        return lib


def _start(source: str, d: Path, index: tuple[str, ...] = ()) -> ctypes.CDLL | PendingUnit:
    """One unit: loaded (this process had it, or the cache has it) or a :class:`PendingUnit`."""
    key = cache_key(source)
    lib = _loaded.get(key)
    so = d / f"{key}.so"
    if lib is None and _valid(so):
        metrics.incr("kernel_cache_hits")
        lib = _loaded[key] = ctypes.CDLL(str(so))
    return lib if lib is not None else PendingUnit(source, key, d, index)


def start_many(sources: list[str]) -> list[ctypes.CDLL | PendingUnit]:
    """Each translation unit loaded from the cache, or a :class:`PendingUnit` being built (the
    build threads compile up to ``MAX_JOBS`` units at a time)."""
    d = kernel_dir()
    return [_start(src, d) for src in sources]


def build_many(sources: list[str]) -> list[ctypes.CDLL]:
    """Compile (or fetch from the cache) each translation unit, in parallel; load them all."""
    return [u.wait() if isinstance(u, PendingUnit) else u for u in start_many(sources)]


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
    """The library of each kernel of a set, some of them still being built; :meth:`wait`."""

    def __init__(self, libs: dict[str, tuple[ctypes.CDLL | PendingUnit, str]]) -> None:
        self._libs = libs  # kernel id -> (library or pending unit, kernel key)

    @property
    def running(self) -> bool:
        return any(isinstance(u, PendingUnit) and u.running for u, _ in self._libs.values())

    @property
    def n_units(self) -> int:
        return len({id(u) for u, _ in self._libs.values()})

    def wait(self) -> dict[str, ctypes.CDLL]:
        """Each kernel's library, waiting for the units still being built (the time spent
        waiting is counted in microseconds: ``kernel_wait_us``)."""
        out = {}
        t0 = time.perf_counter()
        for k, (u, kkey) in self._libs.items():
            if isinstance(u, PendingUnit):
                out[k] = u.wait()
                _units_of[kkey] = u.key
                _inflight.pop(kkey, None)
            else:
                out[k] = u
        metrics.incr("kernel_wait_us", round((time.perf_counter() - t0) * 1e6))
        return out


_inflight: dict[str, PendingUnit] = {}  # kernel key -> the unit being built that holds it


def start_kernels(
    kernels: dict[str, tuple[str, tuple[str, ...]]],
    prelude: str,
    split_at: int,
    split_chars: int = 0,
) -> PendingKernels:
    """Where each kernel will come from: ``kernels`` maps an id to (C++ source, symbols it
    defines), each compiled after ``prelude``.  A kernel some unit already holds (this process,
    or the on-disk index) or is being built into (this process) comes from that unit; the others
    go into new units (more than ``split_at`` kernels, or more than ``split_chars`` characters of
    source when that is not 0: two units of about equal source, built in parallel), that the build
    threads compile and list in the index as soon as each has landed."""
    if not kernels:
        return PendingKernels({})
    d = kernel_dir()
    keys = {k: kernel_key(prelude, src) for k, (src, _) in kernels.items()}
    libs: dict[str, tuple[ctypes.CDLL | PendingUnit, str]] = {}
    new: list[str] = []
    for k in sorted(kernels):
        # a unit this process is building first: another process may have landed the same unit
        # and listed it in the index meanwhile, and loading it from there as well would count
        # one unit twice (kernel_cache_hits)
        building = _inflight.get(keys[k])
        if building is not None and building._pid == os.getpid() and not building.failed:
            libs[k] = (building, keys[k])
        elif (found := _from_index(keys[k], kernels[k][1], d)) is not None:
            libs[k] = (found[0], keys[k])
        else:
            new.append(k)
            continue
        metrics.incr("kernels_reused")
    if new:
        for u in _split(new, {k: len(kernels[k][0]) for k in new}, split_at, split_chars):
            src = prelude + "\n".join(kernels[k][0] for k in u)
            lib = _start(src, d, tuple(keys[k] for k in u))
            if isinstance(lib, PendingUnit):  # the build thread lists it in the index
                _inflight.update((keys[k], lib) for k in u)
            else:
                _list_in_index(cache_key(src), [keys[k] for k in u])
            for k in u:
                libs[k] = (lib, keys[k])
    return PendingKernels(libs)


def _split(
    new: list[str], size: dict[str, int], split_at: int, split_chars: int
) -> list[list[str]]:
    """The new kernels' units: one, or two of about equal source size (g++ time grows with it:
    one long kernel would otherwise keep a whole unit waiting), each sorted by id."""
    total = sum(size.values())
    if len(new) <= split_at and not (split_chars and total > split_chars):
        return [new]
    units: list[list[str]] = [[], []]
    sizes = [0, 0]
    for k in sorted(new, key=lambda k: (-size[k], k)):  # longest first, to the smaller unit
        i = 0 if sizes[0] <= sizes[1] else 1
        units[i].append(k)
        sizes[i] += size[k]
    return [sorted(u) for u in units if u]


def _list_in_index(ukey: str, kkeys: list[str]) -> None:
    """Name the unit ``ukey`` (landed) as the holder of these kernels, in the index and here."""
    index = _index_dir()
    for kkey in kkeys:
        if _units_of.get(kkey) != ukey:
            _write_atomic(index / kkey, ukey.encode())
            _units_of[kkey] = ukey


def build_kernels(
    kernels: dict[str, tuple[str, tuple[str, ...]]],
    prelude: str,
    split_at: int,
    split_chars: int = 0,
) -> dict[str, ctypes.CDLL]:
    """:func:`start_kernels`, waited for: the library holding each kernel."""
    return start_kernels(kernels, prelude, split_at, split_chars).wait()


def forget_loaded() -> None:
    """Drop the in-process tables of loaded libraries and of the units holding each kernel
    (tests use it to force a lookup in the on-disk cache)."""
    _loaded.clear()
    _units_of.clear()
    _inflight.clear()
