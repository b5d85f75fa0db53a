"""Memory statistics of the kiln device: the buffers of live kiln tensors (the Python recorder's
storages here, plus the native recorder's, which it counts itself: ``native.held_bytes``).

Storages that hold data are tracked weakly; the current total is summed on demand (each buffer
once), and the peak is sampled after every step and every upload."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_peak = 0


def track(st: Any) -> None:
    """Count ``st`` (a lazy Storage that now holds data) in the memory statistics."""
    _live.add(st)


def _allocated() -> int:
    seen: set[int] = set()
    native = sys.modules.get("kiln.frontends.lazy.native")  # (not imported: never loaded)
    total = native.held_bytes() if native is not None and native.loaded() else 0
    for st in list(_live):
        data = st.data
        # no buffer: not materialized, or a zero tensor (autograd's efficient zeros) / non-strided
        if data is None or data.layout != torch.strided or data._is_zerotensor():
            continue
        try:
            s = data.untyped_storage()
        except (RuntimeError, NotImplementedError):  # other tensor kinds without one storage
            continue
        key = s.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def update_peak() -> None:
    """Fold the current allocation into the peak."""
    global _peak
    _peak = max(_peak, _allocated())


def peak() -> int:
    return _peak


def reset_peak() -> None:
    global _peak
    _peak = _allocated()
