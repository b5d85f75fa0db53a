"""The backend interface and registry.

A backend says which nodes it claims (generates code for), which passes it adds after the
graph-optimization pipeline (its fusion and memory-planning policy, given its claims), and how it
turns an optimized graph into something that runs.  Backends
register themselves by name; ``config.backend`` (``KILN_BACKEND``) picks one, and the compile path
asks the registry, never a backend by name::

    register_backend(Backend("interpreter", build=lambda g: (Interpreter(g), {...})))
    get_backend(config.backend).build(graph)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kiln.config import Config, ConfigError
from kiln.ir.graph import Graph
from kiln.passes.fuse import Claims

Pass = Callable[[Graph], Graph]
Run = Callable[[Sequence[Any]], list[Any]]


@dataclass(frozen=True)
class Backend:
    name: str
    # optimized graph -> (run(inputs) -> outputs, info for ``kiln explain``: {"backend": name, ...})
    build: Callable[[Graph], tuple[Run, dict]]
    # (name, pass) steps this backend adds after the generic pipeline (fusion, memory planning)
    passes: Callable[[], list[tuple[str, Pass]]] = field(default=lambda: [])
    # the nodes it generates code for (element types, and a predicate per call): the fusion pass
    # it adds groups only these; None: it claims none (runs every node by its op record)
    claims: Claims | None = None


_BACKENDS: dict[str, Backend] = {}


def register_backend(b: Backend, replace: bool = False) -> Backend:
    if b.name in _BACKENDS and not replace:
        raise ValueError(f"a Kiln backend named {b.name!r} is already registered")
    _BACKENDS[b.name] = b
    return b


def unregister_backend(name: str) -> None:
    _BACKENDS.pop(name, None)


def get_backend(name: str) -> Backend:
    b = _BACKENDS.get(name)
    if b is None:
        raise ConfigError(
            f"no Kiln backend named {name!r}; registered: {', '.join(sorted(_BACKENDS))} "
            "(set KILN_BACKEND / kiln.config.backend to one of them, or import the package that "
            "registers it first)"
        )
    return b


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


Config.register_choices("backend", backend_names)  # config.backend: a registered backend
