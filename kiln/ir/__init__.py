"""Kiln's graph IR: immutable typed nodes, an op table with categories, a verifier and a printer."""

from kiln.ir.graph import Graph, GraphBuilder, In, Node, TensorType
from kiln.ir.ops import Category, category
from kiln.ir.printer import format_graph
from kiln.ir.verifier import VerificationError, verify

__all__ = [
    "Category",
    "Graph",
    "GraphBuilder",
    "In",
    "Node",
    "TensorType",
    "VerificationError",
    "category",
    "format_graph",
    "verify",
]
