"""ATen -> Kiln IR: the rule table (kiln.ir.ops) and the explicit fallback table with reasons."""

from kiln.lowering.aten import Ref, lower_call, op_name
from kiln.lowering.fallback import FALLBACK

__all__ = ["FALLBACK", "Ref", "lower_call", "op_name"]
