"""Reading the arguments of a traced optimizer call, for the list forms' checks (what Dynamo
knows as Python constants, lists of tensor variables, their dtype and device), and rounding
per-parameter float64 numbers as ATen rounds a Python float argument.  Shared by
:mod:`kiln.frontends.compile.optimizer_forms` and
:mod:`kiln.frontends.compile.optimizer_forms_adaptive`.

bfloat16 / float16 parameters: ATen's CPU kernels compute such an op in float and round its
result once, and read most Python-number arguments at float precision (``mul``/``div``'s number,
``lerp``'s weight, ``addcdiv``'s value; ``add``'s ``alpha`` is rounded to the tensors' dtype,
``kiln/codegen/cpp/scalars.py``).  A per-parameter number (a bias correction, a scheduled
``lr``) is a 0-dim tensor in the forms: a float32 one where the kernel reads the number at float
precision (:func:`one_each`), and where ATen's op would round a tensor argument itself (``lerp``,
``addcdiv`` with a tensor for ``value``) the op is computed on float32 copies and rounded once
(:func:`lerped_`, :func:`addcdiv_`)."""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# dtypes whose ATen CPU kernels compute in float (the op math type) and round the result once
REDUCED = (torch.bfloat16, torch.float16)


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen's CPU kernels compute an op on ``dtype`` tensors in."""
    return torch.float32 if dtype in REDUCED else dtype


def one_each(values: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """A float64 vector of per-parameter numbers as 0-dim tensors, each rounded as ATen's CPU
    ``mul``/``div`` kernels read a Python float argument of an op on ``dtype`` tensors: to
    ``dtype``, or for bf16 / fp16 to float32 (a one-element second operand is read at float
    precision there, as a Python number is)."""
    return list(values.to(opmath(dtype)).unbind(0))


def alpha_each(values: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """A float64 vector of per-parameter ``alpha`` arguments of ``add`` as 0-dim tensors of
    ``dtype``: ATen's ``add`` kernel rounds ``alpha`` to the tensors' dtype."""
    return list(values.to(dtype).unbind(0))


def _floats(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies of bf16 / fp16 tensors, for an op ATen computes in float."""
    return [aten._to_copy.default(t, dtype=torch.float32) for t in tensors]


def factor(value: Any, n: int, inputs: bool) -> Any:
    """A hyperparameter for ``n`` parameters: the Python number itself, or with ``inputs`` a
    float64 vector of ``n`` copies.  ``inputs``: a scheduler changed this number (``lr``, a beta
    or the momentum) and Dynamo made it symbolic; as tensor math the graph takes its value as an
    input instead of being specialized on it (compiled again for every value), and each use
    rounds it as ATen rounds a Python float argument (:func:`one_each`, :func:`alpha_each`).
    A number the scheduler leaves alone stays a constant (``LambdaLR`` changes ``lr`` only)."""
    return torch.ones(n, dtype=torch.float64) * value if inputs else value


def negated_lr(lr: Any, n: int, inputs: bool) -> Any:
    """``-lr`` as :func:`factor` gives it."""
    f = factor(lr, n, inputs)
    return f.neg() if isinstance(f, torch.Tensor) else -f


def l2_grads(
    grads: list[torch.Tensor], params: list[torch.Tensor], maximize: bool, weight_decay: float
) -> list[torch.Tensor]:
    """The loops' gradient before the update: ``grad = -grad`` if ``maximize``, then
    ``grad = grad.add(param, alpha=weight_decay)`` (L2 weight decay) unless it is 0."""
    if maximize:
        grads = aten._foreach_neg.default(grads)
    if weight_decay != 0:
        grads = aten._foreach_add.List(grads, params, alpha=weight_decay)
    return grads


def decayed_grads(
    grads: list[torch.Tensor],
    params: list[torch.Tensor],
    lr: Any,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The Adam family's prelude (Adam/AdamW, NAdam, RAdam): ``grad = -grad`` if ``maximize``;
    then decoupled weight decay ``param.mul_(1 - lr * weight_decay)`` (the factor in float64,
    rounded as ATen rounds a Python float) or L2 weight decay (:func:`l2_grads`)."""
    if decoupled and weight_decay != 0:
        lr_t = torch.ones((), dtype=torch.float64) * lr
        aten._foreach_mul_.Tensor(params, (1 - lr_t * weight_decay).to(opmath(dtype)))
    return l2_grads(grads, params, maximize, 0 if decoupled else weight_decay)


def moments_(
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grads: list[torch.Tensor],
    b1: Any,
    b2: Any,
    dtype: torch.dtype,
) -> None:
    """The Adam family's moments: ``exp_avg.lerp_(grad, 1 - beta1)``;
    ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`` (``b1``, ``b2`` numbers or
    :func:`factor` vectors)."""
    lerped_(exp_avgs, grads, 1 - b1, dtype)
    multiplied_(exp_avg_sqs, b2, dtype)
    squares_added_(exp_avg_sqs, grads, 1 - b2, dtype)


def scaled(tensors: list[torch.Tensor], f: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """``t * f`` for each tensor, ``f`` a Python number or a :func:`factor` vector."""
    if isinstance(f, torch.Tensor):
        return aten._foreach_mul.List(tensors, one_each(f, dtype))
    return aten._foreach_mul.Scalar(tensors, f)


def multiplied_(tensors: list[torch.Tensor], f: Any, dtype: torch.dtype) -> None:
    """``t.mul_(f)`` for each tensor (a number or a :func:`factor` vector)."""
    if isinstance(f, torch.Tensor):
        aten._foreach_mul_.List(tensors, one_each(f, dtype))
    else:
        aten._foreach_mul_.Scalar(tensors, f)


def lerped_(
    tensors: list[torch.Tensor], ends: list[torch.Tensor], weight: Any, dtype: torch.dtype
) -> None:
    """``t.lerp_(end, weight)`` for each tensor (a number or a :func:`factor` vector).  A
    bf16 / fp16 ``lerp`` with a tensor weight rounds the weight to the tensors' dtype, where
    eager's Python-number weight is read at float precision: computed on float32 copies there."""
    if not isinstance(weight, torch.Tensor):
        aten._foreach_lerp_.Scalar(tensors, ends, weight)
    elif dtype in REDUCED:
        lerped = aten._foreach_lerp.List(_floats(tensors), _floats(ends), one_each(weight, dtype))
        aten._foreach_copy_.default(tensors, lerped)
    else:
        aten._foreach_lerp_.List(tensors, ends, one_each(weight, dtype))


def addcdiv_(
    targets: list[torch.Tensor],
    nums: list[torch.Tensor],
    dens: list[torch.Tensor],
    value: Any,
    dtype: torch.dtype,
) -> None:
    """``targets[i].addcdiv_(nums[i], dens[i], value=value)`` as ATen's CPU kernel computes it,
    ``t + (value * n) / d`` in the op math type, rounded once; ``value`` a Python number or a
    :func:`factor` vector.  In float32 / float64 each op of that spelling rounds as the kernel's
    arithmetic does; in bf16 / fp16 a number goes to ATen's own ``addcdiv`` and a vector's ops
    run on float32 copies (``addcdiv`` takes no tensor ``value``)."""
    if dtype not in REDUCED:
        one = isinstance(value, (int, float)) and value == 1
        update = aten._foreach_div.List(nums if one else scaled(nums, value, dtype), dens)
        aten._foreach_add_.List(targets, update)
    elif not isinstance(value, torch.Tensor):
        aten._foreach_addcdiv_.Scalar(targets, nums, dens, value)
    else:
        update = aten._foreach_div.List(scaled(_floats(nums), value, dtype), _floats(dens))
        aten._foreach_copy_.default(targets, aten._foreach_add.List(_floats(targets), update))


def squares_added_(
    tensors: list[torch.Tensor], grads: list[torch.Tensor], value: Any, dtype: torch.dtype
) -> None:
    """``t.addcmul_(g, g, value=value)`` for each tensor, ``fma(value * g, g, t)`` as ATen's CPU
    kernel computes it; with a :func:`factor` vector, ``value * g`` is its own op (rounded to
    ``dtype`` as ATen's product is) and ``addcmul_`` takes it with ``value=1``; in bf16 / fp16,
    where ATen keeps the product in float, on float32 copies rounded once."""
    if not isinstance(value, torch.Tensor):
        aten._foreach_addcmul_.Scalar(tensors, grads, grads, value)
    elif dtype in REDUCED:
        floats, g = _floats(tensors), _floats(grads)
        added = aten._foreach_addcmul.Scalar(floats, scaled(g, value, dtype), g, 1)
        aten._foreach_copy_.default(tensors, added)
    else:
        aten._foreach_addcmul_.Scalar(tensors, scaled(grads, value, dtype), grads, 1)


def added_scaled(
    params: list[torch.Tensor], others: list[torch.Tensor], alpha: Any, dtype: torch.dtype
) -> None:
    """``params[i].add_(others[i], alpha=alpha)``, one fused multiply-add per element as ATen's
    CPU kernel computes it (``vec::fmadd``).  ``alpha`` a Python number: ATen's own ``add``; a
    :func:`factor` vector: spelled ``addcmul_(p, o, alpha_i, value=1)``, i.e.
    ``fma(1 * o, alpha_i, p)``."""
    if isinstance(alpha, torch.Tensor):
        aten._foreach_addcmul_.Scalar(params, others, alpha_each(alpha, dtype), 1)
    else:
        aten._foreach_add_.List(params, others, alpha=alpha)


def plus_scaled(
    xs: list[torch.Tensor], others: list[torch.Tensor], alpha: Any, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``xs[i].add(others[i], alpha=alpha)``, out of place, as :func:`added_scaled`."""
    if isinstance(alpha, torch.Tensor):
        return aten._foreach_addcmul.Scalar(xs, others, alpha_each(alpha, dtype), 1)
    return aten._foreach_add.List(xs, others, alpha=alpha)


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


def plain_numbers(values: dict[str, Any], names: tuple[str, ...]) -> bool:
    """``values[name]`` an int or float (not a bool) for every name."""
    return all(
        isinstance(values[n], (int, float)) and not isinstance(values[n], bool) for n in names
    )


def cpu_state(tensor_vars: list[Any], steps: list[Any]) -> bool:
    """The parameters, gradients and state tensors (parameters first) on the CPU with the
    parameters' dtype, and the step counters on the CPU with one dtype of their own."""
    return cpu_one_dtype(tensor_vars, tensor_vars[0].dtype) and cpu_one_dtype(steps, steps[0].dtype)


def number(vt: Any) -> bool:
    """A Python number: a constant, or a float Dynamo made symbolic after it changed between
    calls (a learning rate a scheduler sets: the form's Python arithmetic on it is traced as
    the loop's is, in double)."""
    from torch._dynamo.variables import SymNodeVariable

    known, value = constant(vt)
    if known:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(vt, SymNodeVariable) and vt.python_type() in (int, float)


def loop_lists(
    args: list[Any],
    kwargs: dict[str, Any],
    n_lists: int,
    numbers: tuple[str, ...],
    flags: tuple[str, ...],
    scheduled: tuple[str, ...],
) -> list[list[Any]] | None:
    """The tensor lists of a traced call of one of torch's per-tensor loops, where the call is
    one a list form can take, else None: ``n_lists`` lists of tensor variables (positional, of
    one length, not empty), as ``torch.optim`` passes them; ``numbers`` (int or float) and
    ``flags`` keyword constants, not ``differentiable`` and no complex parameters (``flags``
    names both); ``scheduled`` keyword Python numbers (constants, or floats a scheduler made
    symbolic).  What the tensors must be (devices, dtypes) is the caller's to check."""
    if len(args) != n_lists:
        return None
    consts = constants(kwargs, numbers + flags)
    if consts is None or consts["differentiable"] or consts["has_complex"]:
        return None
    if not plain_numbers(consts, numbers):
        return None
    if not all(name in kwargs and number(kwargs[name]) for name in scheduled):
        return None
    lists: list[list[Any]] = []
    for a in args:
        items = tensors(a)
        if items is None:
            return None
        lists.append(items)
    if not lists[0] or len({len(t) for t in lists}) != 1:
        return None
    return lists
