"""Compatibility names: the reference interpreter is a backend (:mod:`kiln.codegen.interpreter`)
and op semantics live in the IR (:mod:`kiln.ir.semantics`); import them from there."""

from kiln.codegen.interpreter import Interpreter
from kiln.ir.semantics import (
    PYOPS,
    call_node,
    fill,
    infer_types,
    last_uses,
    resolve,
    shape_dim,
    types_of,
    writeback,
)

__all__ = [
    "PYOPS",
    "Interpreter",
    "call_node",
    "fill",
    "infer_types",
    "last_uses",
    "resolve",
    "shape_dim",
    "types_of",
    "writeback",
]
