"""``torch.kiln``: the device module PyTorch and libraries look up for the kiln device.

PyTorch's own code finds a device's module with ``torch.get_device_module("kiln")`` (activation
checkpointing, ``torch.autocast``, ``torch.random.fork_rng``, ``torch.amp.GradScaler``,
``torch.accelerator``), so this follows ``torch.cuda``'s interface where it means something for a
lazy device that lives in CPU memory:

- one device, ``kiln:0``; ``set_device``/``device`` accept only index 0;
- autocast: ``get_amp_supported_dtype`` (bfloat16, float16) and the ``torch.autocast("kiln")``
  state accessors; the casting rules are in :mod:`kiln.frontends.lazy.autocast`;
- RNG: the kiln device draws the seeds of its random ops from torch's CPU generator, so its RNG
  state *is* the CPU generator's state (``get_rng_state``/``set_rng_state``/``manual_seed``);
  restoring a state taken earlier in the same step makes the following random ops repeat the
  draws recorded after it, as eager does (activation checkpointing relies on it);
- memory statistics count the buffers of live kiln tensors (``memory_allocated``), with the peak
  taken at each ``mark_step`` and at each upload; Kiln caches no freed memory, so
  ``memory_reserved`` equals ``memory_allocated`` and ``empty_cache`` has nothing to release;
- streams and events: the lazy device runs one step at a time on the host, so a ``Stream`` is a
  no-op ordering object and an ``Event`` records a host timestamp after pending work ran.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kiln import metrics
from kiln.frontends.lazy.memory import _allocated, peak, reset_peak, update_peak
from kiln.runtime.steps import step_end

# Why PyTorch's autograd engine cannot serve the kiln device in this process: the reason and the
# fix; None while it can (or is not known yet).
unusable: str | None = None
# Set by registration: the check that makes the engine serve the device or finds ``unusable``.
# It runs a backward pass, which starts the engine's device thread, and PyTorch then refuses
# autograd in forked children; so it runs at the first use of the device, not at ``import kiln``.
pending_probe: Callable[[], str | None] | None = None


def sync_all() -> None:
    """Cut and run both recorders' pending traces (``kiln.mark_step``): the Python recorder's,
    and the native recorder's once it is loaded (``config.lazy_recorder = "native"``); then the
    step ends."""
    from kiln.frontends.lazy.trace import sync

    sync(ends_step=False)
    native = sys.modules.get("kiln.frontends.lazy.native")  # (not imported: never loaded)
    if native is not None and native.loaded():
        native.mark_step(ends_step=False)
    # one step, whichever recorder had work, and also where none had (the debug mode runs every
    # op at once: its mark_step finds nothing pending)
    step_end(metrics.get("mark_steps"))


# Whether this process has used the kiln device (``kiln.device()``, a kiln factory, ``.to``).
_used = False


def in_use() -> bool:
    """``torch.kiln.is_available()`` and ``torch.accelerator.is_available()``: True once this
    process has used the kiln device and it works here.  The lazy device is opt-in, as
    PyTorch/XLA's is: a program that only imports kiln (compile mode, or nothing of Kiln's)
    keeps PyTorch's answer for a machine without an accelerator, so libraries that pick the
    process's accelerator on their own stay on the CPU as they would without kiln (accelerate,
    under the transformers Trainer, called ``torch.accelerator.empty_cache()``, which failed on
    an internal assert: the kiln device has no caching allocator)."""
    return _used and unusable is None


def check_usable() -> None:
    """Raise if the kiln device cannot work in this process (probing it first if still pending).
    Called at the device's first use (and at every use while a probe is pending)."""
    global unusable, pending_probe, _used
    _used = True
    probe = pending_probe
    if probe is not None:
        pending_probe = None  # before probing: the probe itself makes kiln tensors
        unusable = probe()
    if unusable is not None:
        raise RuntimeError(unusable)


def _index(device: Any) -> int:
    """Device index of ``device`` (None, int, str or torch.device); raises for anything but kiln:0."""
    if device is None:
        return 0
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "kiln":
            raise ValueError(f"expected a kiln device, got {device}")
        idx = 0 if device.index is None else device.index
    elif isinstance(device, int):
        idx = device
    else:
        raise TypeError(f"expected a kiln device or index, got {device!r}")
    if idx != 0 and idx != -1:
        raise ValueError(
            f"kiln:{idx} does not exist: Kiln has one lazy device, kiln:0 (valid: 'kiln', 'kiln:0')"
        )
    return 0


class _KilnModule:
    """The object registered as ``torch.kiln``."""

    # torch.utils.checkpoint stashes a device's RNG state only once the device is initialized.
    _initialized = True

    # ---- device selection -------------------------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        return in_use()

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _lazy_init() -> None:
        """Nothing to initialize: the device exists once kiln is imported."""

    init = _lazy_init

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        _index(device)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        _index(device)
        return "Kiln lazy device (host CPU)"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import psutil

        _index(device)
        from types import SimpleNamespace

        return SimpleNamespace(
            name="Kiln lazy device (host CPU)",
            total_memory=psutil.virtual_memory().total,
            multi_processor_count=torch.get_num_threads(),
        )

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        import psutil

        _index(device)
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    class device:
        """``with torch.kiln.device(0):`` -- there is one device, so only index 0 is accepted."""

        def __init__(self, device: Any) -> None:
            self.idx = _index(device)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> bool:
            return False

    class device_of(device):
        def __init__(self, obj: Any) -> None:
            super().__init__(obj.device if isinstance(obj, torch.Tensor) else obj)

    # ---- autocast -------------------------------------------------------------------------
    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def is_autocast_enabled() -> bool:
        return torch.is_autocast_enabled("kiln")

    @staticmethod
    def set_autocast_enabled(enabled: bool) -> None:
        torch.set_autocast_enabled("kiln", enabled)

    @staticmethod
    def get_autocast_dtype() -> torch.dtype:
        return torch.get_autocast_dtype("kiln")

    @staticmethod
    def set_autocast_dtype(dtype: torch.dtype) -> None:
        torch.set_autocast_dtype("kiln", dtype)

    # ---- RNG: the CPU generator's state -----------------------------------------------------
    # Not traced by Dynamo (code that saves/restores the accelerator's RNG around a compiled op,
    # e.g. torch.testing's freeze_rng_state, runs these under no_dispatch): a graph break instead.
    @staticmethod
    @torch.compiler.disable
    def get_rng_state(device: Any = None) -> torch.Tensor:
        from kiln.frontends.lazy.trace import rng_mark

        _index(device)
        state = rng_mark(torch.get_rng_state())
        native_rng = _native_rng()
        if native_rng is not None:
            native_rng.mark(state)
        return state

    @staticmethod
    @torch.compiler.disable
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        from kiln.frontends.lazy.trace import rng_rewind

        _index(device)
        torch.set_rng_state(state)
        rng_rewind(state)
        native_rng = _native_rng()
        if native_rng is not None:
            native_rng.rewind(state)

    @staticmethod
    def get_rng_state_all() -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    @staticmethod
    def set_rng_state_all(states: list[torch.Tensor]) -> None:
        for s in states:
            torch.set_rng_state(s)

    @staticmethod
    def manual_seed(seed: int) -> None:
        # torch.default_generator, not torch.manual_seed: that one calls manual_seed_all of every
        # device module, this one included.
        torch.default_generator.manual_seed(int(seed))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    @staticmethod
    def seed() -> None:
        torch.default_generator.seed()

    seed_all = seed

    @staticmethod
    def initial_seed() -> int:
        return torch.default_generator.initial_seed()

    # ---- execution and memory -------------------------------------------------------------
    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Run all pending lazy work (what :func:`kiln.mark_step` does)."""
        _index(device)
        sync_all()

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        """Bytes held by the buffers of live kiln tensors (pending results not counted)."""
        _index(device)
        return _allocated()

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        """Peak of :func:`memory_allocated`, sampled after every step and upload."""
        _index(device)
        update_peak()
        return peak()

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        _index(device)
        reset_peak()

    reset_max_memory_allocated = reset_peak_memory_stats

    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated

    @staticmethod
    def empty_cache() -> None:
        """Kiln keeps no cache of freed tensor memory: a buffer goes when its last tensor does."""

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        _index(device)
        update_peak()
        cur = _allocated()
        return {
            "allocated_bytes.all.current": cur,
            "allocated_bytes.all.peak": peak(),
            "reserved_bytes.all.current": cur,
            "reserved_bytes.all.peak": peak(),
        }

    # ---- streams and events ---------------------------------------------------------------
    class Stream:
        """The lazy device's only stream: work runs in program order at each step."""

        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            self.device = torch.device("kiln", _index(device))
            self.priority = priority

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            _KilnModule.synchronize()

        def wait_stream(self, stream: Any) -> None:
            """Program order already holds between kiln streams."""

        def wait_event(self, event: Any) -> None:
            """Program order already holds between kiln streams."""

        def record_event(self, event: Any = None) -> Any:
            event = event if event is not None else _KilnModule.Event()
            event.record(self)
            return event

        def __eq__(self, other: object) -> bool:
            return isinstance(other, _KilnModule.Stream)

        def __hash__(self) -> int:
            return hash("kiln-stream")

    class Event:
        """A host timestamp taken after the pending work ran (``enable_timing`` is ignored:
        timing is always available)."""

        def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
            self.t: float | None = None

        def record(self, stream: Any = None) -> None:
            _KilnModule.synchronize()
            self.t = time.perf_counter()

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            """Recording already ran the pending work."""

        def wait(self, stream: Any = None) -> None:
            """Program order already holds."""

        def elapsed_time(self, end: _KilnModule.Event) -> float:
            if self.t is None or end.t is None:
                raise RuntimeError("both events must be recorded before elapsed_time()")
            return (end.t - self.t) * 1000.0

    @staticmethod
    def current_stream(device: Any = None) -> _KilnModule.Stream:
        return _KilnModule.Stream(device)

    default_stream = current_stream

    @staticmethod
    def set_stream(stream: Any) -> None:
        """One stream: nothing to switch."""

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: Any) -> Iterator[None]:
        yield


KILN_MODULE = _KilnModule()


def _native_rng() -> Any:
    """The native recorder's random-op state (``native/rng.py``) when it is loaded, else None."""
    native_rng = sys.modules.get("kiln.frontends.lazy.native.rng")
    return native_rng.active() if native_rng is not None else None
