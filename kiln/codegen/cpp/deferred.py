"""A graph whose kernels are still being compiled: the backend returns it at once, so g++ runs
while PyTorch goes on tracing the next graph; its first run waits for the build and makes the
real executor (a g++ failure raises :class:`kiln.codegen.cpp.build.BuildError` there, at every
run, naming the compiler's error)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kiln.codegen.cpp.executor import Executor


class Deferred:
    """Stands for the :class:`Executor` that ``make`` returns once the build is waited for."""

    steals = True  # as Executor: may take over its caller's input list

    def __init__(self, make: Callable[[], Executor]) -> None:
        self._make = make
        self._exe: Executor | None = None
        self._lock = threading.Lock()

    def executor(self) -> Executor:
        """The real executor, waiting for g++ on the first call."""
        if self._exe is None:
            with self._lock:
                if self._exe is None:
                    self._exe = self._make()
        return self._exe

    def __call__(self, inputs: Sequence[Any], steal: bool = False) -> list[Any]:
        return self.executor()(inputs, steal)

    def __getattr__(self, name: str) -> Any:
        # anything else (``native``, ``source``, ``graph``...) is the executor's: waits for it
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.executor(), name)
