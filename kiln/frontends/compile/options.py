"""``torch.compile``'s ``mode`` and ``options`` for ``backend="kiln"``.

    torch.compile(step, backend="kiln", options={"disable_passes": "cse", "checks": True})

``options`` are Kiln config keys (:mod:`kiln.config`) in force for that compiled function's
graphs (its Dynamo graphs and AOTAutograd's forward and backward compiles of them, also when
loaded from the compile cache), the process's config everywhere else.  Only keys that shape a
compile are taken; a key that configures the process (the lazy device's, the cache folder, the
observers) raises and names ``kiln.config.update``, an unknown key raises and names the valid
ones, a bad value raises as ``kiln.config.update`` does.

``mode`` selects Inductor's features (CUDA graphs, autotuning); ``None`` and ``"default"`` are
Kiln's defaults, any other mode warns once that Kiln ignores it.
"""

from __future__ import annotations

import warnings
from typing import Any

from kiln.config import Config, ConfigError, config

# config keys that shape one compile (read while Kiln lowers, optimizes and builds a graph)
COMPILE_OPTIONS = (
    "backend",
    "checks",
    "disable_passes",
    "disk_cache",
    "explain_dir",
    "launcher",
    "log",
    "recompute",
    "sr_seed",
    "stochastic_rounding",
)
_warned_modes: set[str] = set()


def compile_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take ``mode`` and ``options`` out of a backend call's keyword arguments: the options,
    checked (:class:`~kiln.config.ConfigError` for a key or value Kiln does not take)."""
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default") and mode not in _warned_modes:
        _warned_modes.add(mode)
        warnings.warn(
            f"Kiln: torch.compile(mode={mode!r}) selects Inductor features (CUDA graphs, "
            "autotuning); backend='kiln' ignores it and compiles with its defaults",
            stacklevel=2,
        )
    options = dict(kwargs.pop("options", None) or {})
    for key in options:
        if key in COMPILE_OPTIONS:
            continue
        if key in Config.names():
            raise ConfigError(
                f"Kiln option {key!r} configures the process, not one compile: set it with "
                f"kiln.config.update({key}=...) or KILN_{key.upper()}; compile options: "
                + ", ".join(COMPILE_OPTIONS)
            )
        raise ConfigError(
            f"unknown Kiln compile option {key!r}; valid: " + ", ".join(COMPILE_OPTIONS)
        )
    return config.check(**options)  # values checked now, as kiln.config.update checks them
