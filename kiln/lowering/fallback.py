"""Ops Kiln deliberately does not lower, each with its reason (read from the op records,
:data:`kiln.ir.ops.FALLBACKS`, where they are defined).

An op in this table, or any ATen op with no Kiln rule, becomes an ``opaque`` node: the executor
runs it through ATen exactly as eager PyTorch would, and ``kiln.metrics`` counts it by name.
"""

from kiln.ir.ops import FALLBACKS, fallback_reason

FALLBACK: dict[str, str] = {n: str(d.fallback) for n, d in FALLBACKS.items()}


def reason(packet: str) -> str:
    return fallback_reason(packet)
