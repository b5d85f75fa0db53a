"""One typed configuration object.

Every setting has a field here and an environment variable ``KILN_<NAME>``.  Unknown keys, unknown
``KILN_*`` variables and bad values raise :class:`ConfigError`, naming what is valid.

    import kiln
    kiln.config.update(checks=True)
    KILN_EAGER=1 python train.py
    torch.compile(step, backend="kiln", options={"disable_passes": "cse"})   # one compile
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence


class ConfigError(ValueError):
    pass


def _default_runtime_dir() -> str:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return str(Path(xdg) / "kiln") if xdg else f"/tmp/kiln-{os.getuid()}"


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "kiln")


_BOOL = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
    "": False,
}


@dataclass
class Config:
    checks: bool = False  # verify every graph after every pass (KILN_CHECKS=1)
    eager: bool = False  # lazy device runs every op at once (KILN_EAGER=1)
    cache_dir: str = field(default_factory=_default_cache_dir)  # persistent compile cache
    disk_cache: bool = True  # use the persistent cache at all
    backend: str = "cpp"  # a registered backend (kiln.codegen): "cpp" (C++ kernels), "interpreter"
    launcher: bool = True  # cpp backend: run each graph as one native C++ call (0: Python)
    # where the native launcher is built, once per machine (not per cache_dir: a fresh compile
    # cache does not rebuild it)
    launcher_dir: str = field(default_factory=lambda: str(Path(_default_cache_dir()) / "launcher"))
    disable_passes: str = ""  # comma-separated pass names to switch off
    # glibc: set malloc's mmap/trim thresholds to their ceilings at the first compile, so that a
    # step's large buffers are not unmapped and faulted in again every step (kiln/runtime/malloc.py)
    malloc_tuning: bool = True
    # compile mode: AOTAutograd's min-cut partitioner (as Inductor uses it) recomputes cheap
    # pointwise work in backward instead of saving it (0: save every value backward reads)
    recompute: bool = True
    log: str = ""  # comma-separated: "graphs", "passes", "kernels", "recompiles", "fallbacks"
    recompile_warn: int = 4  # warn when one call site compiles more graphs than this
    max_steps: int = 0  # stop the process after this many steps (precompile/explain); 0 = never
    explain_dir: str = ""  # write a report of every compiled graph here (kiln explain)
    stochastic_rounding: bool = (
        False  # fp32 -> bf16/fp16 casts round stochastically (kiln.precision)
    )
    sr_seed: int = 0  # seed of the stochastic-rounding random bits (kiln.precision.manual_seed)
    gc_freeze: bool = False  # lazy device: gc.freeze() after steps that compiled a new graph
    # lazy device: a step whose only change is a size reuses one shape-generic graph (0: one
    # graph per shape, as PyTorch/XLA)
    dynamic_shapes: bool = True
    # lazy device: which recorder makes kiln tensors: "native" (the C++ recorder,
    # docs/native_recorder.md; built at the device's first use, the Python one where it cannot be)
    # or "python" (kiln/frontends/lazy/tensor.py)
    lazy_recorder: str = "native"
    publish: bool = True  # publish this process's state at step boundaries (kiln ls, kiln top)
    runtime_dir: str = field(default_factory=_default_runtime_dir)  # where state is published
    tensorboard_dir: str = ""  # write Kiln's per-step metrics as TensorBoard events here
    profile: str = ""  # write a Chrome trace of profile_steps steps to this file (kiln profile)
    profile_steps: int = 3  # steps the profile records
    profile_skip: int = 0  # steps run before the profile starts recording (0: from import)

    # key -> the function that lists its valid values, registered by the layer that owns them (the
    # backend registry registers "backend"), so that this module imports nothing from above.  A
    # value read before its choices are registered (KILN_BACKEND, read when kiln.config is first
    # imported) is checked where it is used (kiln.codegen.base.get_backend).
    _CHOICES: ClassVar[dict[str, Callable[[], Sequence[str]]]] = {}
    _MINIMUM = {"profile_steps": 1, "profile_skip": 0}
    _FIXED_CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"lazy_recorder": ("python", "native")}
    _LOG_CHOICES = ("graphs", "passes", "kernels", "recompiles", "fallbacks", "all")

    @classmethod
    def register_choices(cls, key: str, valid: Callable[[], Sequence[str]]) -> None:
        """Values of ``key`` must be among ``valid()`` from now on."""
        cls._CHOICES[key] = valid

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def check(self, **kw: Any) -> dict[str, Any]:
        """``kw`` as :meth:`update` would set them, changing nothing: :class:`ConfigError` for an
        unknown key or a bad value."""
        return self._checked(kw)

    def update(self, **kw: Any) -> None:
        for k, v in self._checked(kw).items():
            setattr(self, k, v)

    @contextlib.contextmanager
    def scoped(self, **kw: Any) -> Iterator[None]:
        """``kw`` in force inside the block (every value checked first), the old values after."""
        new = self._checked(kw)
        old = {k: getattr(self, k) for k in new}
        for k, v in new.items():
            setattr(self, k, v)
        try:
            yield
        finally:
            for k, v in old.items():
                setattr(self, k, v)

    def _checked(self, kw: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in kw.items():
            if k not in self.names():
                raise ConfigError(
                    f"unknown Kiln config key {k!r}; valid keys: {', '.join(self.names())}"
                )
            out[k] = self._check(k, v)
        return out

    def _check(self, k: str, v: Any) -> Any:
        ftype = {f.name: f.type for f in dataclasses.fields(self)}[k]
        if ftype == "bool" and not isinstance(v, bool):
            raise ConfigError(f"config {k!r} must be True or False, got {v!r}")
        if ftype == "int" and not isinstance(v, int):
            raise ConfigError(f"config {k!r} must be an int, got {v!r}")
        if k in self._MINIMUM and v < self._MINIMUM[k]:
            raise ConfigError(f"config {k!r} must be at least {self._MINIMUM[k]}, got {v!r}")
        fixed = self._FIXED_CHOICES.get(k)
        if fixed is not None and v not in fixed:
            raise ConfigError(f"config {k!r} must be one of {', '.join(fixed)}; got {v!r}")
        choices = self._CHOICES.get(k)
        if choices is not None and v not in choices():
            raise ConfigError(f"config {k!r} must be one of {', '.join(choices())}; got {v!r}")
        if k == "log" and v:
            for part in v.split(","):
                if part not in self._LOG_CHOICES:
                    raise ConfigError(
                        f"KILN_LOG part {part!r} is unknown; valid: {', '.join(self._LOG_CHOICES)}"
                    )
        return v

    def log_enabled(self, what: str) -> bool:
        parts = self.log.split(",") if self.log else []
        return what in parts or "all" in parts

    @property
    def disabled_passes(self) -> frozenset[str]:
        return frozenset(p for p in self.disable_passes.split(",") if p)


def from_env(env: dict[str, str] | None = None) -> Config:
    env = dict(os.environ if env is None else env)
    cfg = Config()
    valid = {f"KILN_{n.upper()}": n for n in Config.names()}
    for key, raw in env.items():
        if not key.startswith("KILN_") or key.startswith("KILN_TEST_"):
            continue
        if key not in valid:
            raise ConfigError(
                f"unknown environment variable {key}; valid Kiln variables: "
                + ", ".join(sorted(valid))
            )
        name = valid[key]
        ftype = {f.name: f.type for f in dataclasses.fields(Config)}[name]
        if ftype == "bool":
            if raw.lower() not in _BOOL:
                raise ConfigError(f"{key}={raw!r} is not a boolean; use 1 or 0")
            value: Any = _BOOL[raw.lower()]
        elif ftype == "int":
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{key}={raw!r} is not an integer") from None
        else:
            value = raw
        cfg.update(**{name: value})
    return cfg


config = from_env()
