"""Kiln backends: the reference interpreter and the C++ code generator, behind one interface
(:mod:`kiln.codegen.base`).  Importing this package registers both."""

from kiln.codegen import interpreter as _interpreter  # noqa: F401 - registers "interpreter"
from kiln.codegen.base import Backend, backend_names, get_backend, register_backend

try:
    from kiln.codegen import cpp as _cpp  # noqa: F401 - registers "cpp"
except ImportError as e:  # pragma: no cover - a broken install: the interpreter still runs
    import warnings

    warnings.warn(f"Kiln's C++ backend is unavailable ({e}); graphs run on the interpreter")

__all__ = ["Backend", "backend_names", "get_backend", "register_backend"]
