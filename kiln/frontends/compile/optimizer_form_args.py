"""Reading the arguments of a traced optimizer call, for the list forms' checks (what Dynamo
knows as Python constants, lists of tensor variables, their dtype and device), and rounding
per-parameter float64 numbers as ATen rounds a Python float argument.  Shared by
:mod:`kiln.frontends.compile.optimizer_forms` and
:mod:`kiln.frontends.compile.optimizer_forms_adaptive`."""

from __future__ import annotations

from typing import Any

import torch


def one_each(values: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """A float64 vector of per-parameter numbers as 0-dim tensors of ``dtype``, each rounded as
    ATen rounds a Python float argument of an op on ``dtype`` tensors."""
    return list(values.to(dtype).unbind(0))


def negated_lr(lr: Any, n: int, lr_input: bool) -> Any:
    """``-lr`` for ``n`` parameters: the Python number where ``lr`` is a constant of the graph,
    a float64 vector where it is a graph input (``lr_input``: a scheduler changed it and Dynamo
    made it symbolic), so the graph takes its value instead of being specialized on it."""
    if not lr_input:
        return -lr
    return (torch.ones(n, dtype=torch.float64) * lr).neg()


def scaled(tensors: list[torch.Tensor], factor: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """``t * factor`` for each tensor, ``factor`` a Python number or a float64 vector (one value
    per tensor), rounded to ``dtype`` as ATen rounds a Python float argument."""
    if isinstance(factor, torch.Tensor):
        return torch.ops.aten._foreach_mul.List(tensors, one_each(factor, dtype))
    return torch.ops.aten._foreach_mul.Scalar(tensors, factor)


def added_scaled(
    params: list[torch.Tensor], others: list[torch.Tensor], alpha: Any, dtype: torch.dtype
) -> None:
    """``params[i].add_(others[i], alpha=alpha)``, one fused multiply-add per element as ATen's
    CPU kernel computes it (``vec::fmadd``).  ``alpha`` a Python number: ATen's own ``add``; a
    float64 vector (one value per parameter, rounded to ``dtype`` as ATen rounds a Python
    float): spelled ``addcmul_(p, o, alpha_i, value=1)``, i.e. ``fma(1 * o, alpha_i, p)``."""
    if isinstance(alpha, torch.Tensor):
        torch.ops.aten._foreach_addcmul_.Scalar(params, others, one_each(alpha, dtype), 1)
    else:
        torch.ops.aten._foreach_add_.List(params, others, alpha=alpha)


def constant(vt: Any) -> tuple[bool, Any]:
    """``(True, value)`` for a variable Dynamo knows as a Python constant, else
    ``(False, None)``."""
    if vt.is_python_constant():
        return True, vt.as_python_constant()
    return False, None


def tensors(vt: Any) -> list[Any] | None:
    """The tensor variables of a list variable, or None where it is not one."""
    items = getattr(vt, "items", None)
    if not isinstance(items, list):
        return None
    out = []
    for item in items:
        item = item.realize() if hasattr(item, "realize") else item
        if not hasattr(item, "dtype") or not hasattr(item, "device"):
            return None
        out.append(item)
    return out


def constants(kwargs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any] | None:
    """The Python values of keyword arguments ``names``, or None where one is missing or is not
    a constant to Dynamo."""
    out = {}
    for name in names:
        if name not in kwargs:
            return None
        known, value = constant(kwargs[name])
        if not known:
            return None
        out[name] = value
    return out


def cpu_one_dtype(tensor_vars: list[Any], dtype: torch.dtype) -> bool:
    """Every tensor variable of ``tensor_vars`` on the CPU with ``dtype``."""
    return all(t.dtype == dtype and getattr(t.device, "type", None) == "cpu" for t in tensor_vars)


def number(vt: Any) -> bool:
    """A Python number: a constant, or a float Dynamo made symbolic after it changed between
    calls (a learning rate a scheduler sets: the form's Python arithmetic on it is traced as
    the loop's is, in double)."""
    from torch._dynamo.variables import SymNodeVariable

    known, value = constant(vt)
    if known:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(vt, SymNodeVariable) and vt.python_type() in (int, float)
