"""Stochastic-rounding state: the switch, the seed and the step counter.

Low level (imports only :mod:`kiln.config`), so the code generator and executor may use it.

``KILN_STOCHASTIC_ROUNDING=1`` (``kiln.config.stochastic_rounding``) makes every fp32 -> bf16 / fp16
rounding Kiln compiles stochastic; ``KILN_SR_SEED`` (``kiln.config.sr_seed``) seeds it.  Each launch
of a kernel that rounds stochastically takes :func:`next_key`: a 64-bit mix of (seed, step), where
step counts such launches since the last :func:`manual_seed`.  The key is a run-time argument
(never part of a graph or a kernel's source), so nothing recompiles when it changes, and the same
seed and the same sequence of launches give the same bits.
"""

from __future__ import annotations

import itertools
import threading

from kiln.config import config

_MASK = (1 << 64) - 1
_lock = threading.Lock()
_seed: int | None = None  # None: take config.sr_seed at the first launch
_counter = itertools.count()


def enabled() -> bool:
    return config.stochastic_rounding


def manual_seed(seed: int) -> None:
    """Restart the stochastic-rounding stream at (seed, step 0)."""
    global _seed, _counter
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    with _lock:
        _seed = seed & _MASK
        _counter = itertools.count()


def mix64(z: int) -> int:
    """SplitMix64's finalizer (the same function the kernels use on the element index)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def key_for(seed: int, step: int) -> int:
    return mix64(mix64(seed ^ 0x6B696C6E5F737221) + (step & _MASK) * 0xD1B54A32D192ED03)


def next_key() -> int:
    """The key for the next stochastic-rounding launch (advances the step)."""
    global _seed
    if _seed is None:
        with _lock:
            if _seed is None:
                _seed = config.sr_seed & _MASK
    return key_for(_seed, next(_counter))


def key_halves(key: int) -> tuple[float, float]:
    """The key as two exact doubles (low and high 32 bits), for the kernels' ``D`` array."""
    return float(key & 0xFFFFFFFF), float(key >> 32)
