"""List forms of torch.optim's per-tensor NAdam and RAdam loops, with eager's numbers.

What a form is, why Kiln traces one and where (Kiln's frames only, CPU tensors of one dtype):
:mod:`kiln.frontends.compile.optimizer_forms`, which holds the table these two join, and how
a hyperparameter a scheduler changes becomes a graph input (a form's ``symbolic`` names).

Both loops compute step-dependent factors from ``step = step_t.item()`` in eager: Python floats,
float64.  Dynamo traces the loops' ``capturable`` branches instead, float32 tensor math, and
RAdam's rectification ``sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2)
rho_t))`` cancels badly in float32 on the first steps past ``rho_t > 5``: the trace's parameters
were 1.1e-3 (relative) away from eager's, NAdam's 2.8e-5.  The forms compute those factors in
float64 tensors, as eager computes them in Python, and round each to the parameters' dtype where
eager passes it to ATen as a Python number.

RAdam (``_single_tensor_radam``): ``exp_avg / bias_correction1``; ``* lr``; then, where
``rho_t > 5``, ``* (sqrt(bias_correction2) / (exp_avg_sq.sqrt() + eps))`` -- a Python float
divided by a tensor, which ``Tensor.__rtruediv__`` runs as ``reciprocal() * number`` -- and
``* rect``; ``param.add_(update, alpha=-1)``.  Eager branches on ``rho_t`` per parameter in
Python; the form computes both updates and selects with ``where`` (the branch not taken may be
NaN: ``sqrt`` of a negative number).

NAdam (``_single_tensor_nadam``): ``mu_product *= mu`` in the state's own (scalar) dtype;
``denom = (exp_avg_sq / bias_correction2).sqrt() + eps``; the two ``addcdiv_`` values
``-lr (1 - mu) / (1 - mu_product)`` and ``-lr mu_next / (1 - mu_product mu_next)`` in float64
from the updated ``mu_product`` (``.item()`` in eager), each ``addcdiv_`` in ATen's CPU order
``p + (t * value) / denom``.

Taken only where the form is exact: the loop's arguments as ``torch.optim`` passes them, numbers
Dynamo knows as constants (``lr`` and the betas may also be symbolic floats), no complex
parameters, not ``differentiable``; else Dynamo traces torch's loop.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.frontends.compile.optimizer_form_args import (
    addcdiv_,
    cpu_state,
    decayed_grads,
    factor,
    loop_lists,
    moments_,
    one_each,
    scaled,
)

aten = torch.ops.aten

# the loops' flags the forms read (the last two must be False) and the numbers a scheduler may set
_FLAGS = ("decoupled_weight_decay", "maximize", "differentiable", "has_complex")
_SCHEDULED = ("lr", "beta1", "beta2")


def radam_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.radam._single_tensor_radam`` as list ops, with eager's numbers; only what
    :func:`radam_takes` accepts reaches it (``symbolic``: ``lr`` and the betas as ``factor``
    vectors)."""
    inputs = bool(symbolic)  # a number a scheduler changes is a graph input
    dtype = params[0].dtype
    n = len(params)
    b1, b2 = factor(beta1, n, "beta1" in symbolic), factor(beta2, n, "beta2" in symbolic)
    aten._foreach_add_.Scalar(state_steps, 1)  # step_t += 1
    grads = decayed_grads(grads, params, lr, weight_decay, decoupled_weight_decay, maximize, dtype)
    moments_(exp_avgs, exp_avg_sqs, grads, b1, b2, dtype)
    # step = step_t.item(); the factors below are Python floats in eager: float64
    step = torch.stack(state_steps).to(torch.float64)
    beta2_power = torch.pow(b2, step)
    bias_correction1 = 1 - torch.pow(b1, step)
    bias_correction2 = 1 - beta2_power
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * step * beta2_power / bias_correction2
    radicand = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
    rect = radicand.sqrt()  # NaN where rho_t <= 5: that branch is not taken below
    # bias_corrected_exp_avg * lr
    corrected = aten._foreach_div.List(exp_avgs, one_each(bias_correction1, dtype))
    plain = scaled(corrected, factor(lr, n, inputs), dtype)
    # (bias_correction2 ** 0.5) / exp_avg_sq.sqrt().add_(eps): reciprocal, then the number
    adaptive = aten._foreach_add.Scalar(aten._foreach_sqrt.default(exp_avg_sqs), eps)
    adaptive = aten._foreach_reciprocal.default(adaptive)
    adaptive = aten._foreach_mul.List(adaptive, one_each(bias_correction2.sqrt(), dtype))
    rectified = aten._foreach_mul.List(
        aten._foreach_mul.List(plain, adaptive), one_each(rect, dtype)
    )
    # if rho_t > 5: param.add_(... * adaptive * rect, alpha=-1) else param.add_(..., alpha=-1)
    take = (rho_t > 5.0).unbind(0)
    updates = [aten.where.self(take[i], rectified[i], plain[i]) for i in range(n)]
    aten._foreach_add_.List(params, updates, alpha=-1.0)


def radam_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's RAdam loop is one :func:`radam_form` computes exactly:
    five lists as ``torch.optim.radam.radam`` passes them, the rest by keyword."""
    lists = loop_lists(args, kwargs, 5, ("weight_decay", "eps"), _FLAGS, _SCHEDULED)
    if lists is None:
        return False
    params, grads, exp_avgs, exp_avg_sqs, steps = lists
    return cpu_state(params + grads + exp_avgs + exp_avg_sqs, steps)


def nadam_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    mu_products: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    momentum_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.nadam._single_tensor_nadam`` as list ops, with eager's numbers; only what
    :func:`nadam_takes` accepts reaches it (``symbolic``: ``lr`` and the betas as ``factor``
    vectors)."""
    inputs = bool(symbolic)  # a number a scheduler changes is a graph input
    dtype = params[0].dtype
    n = len(params)
    b1, b2 = factor(beta1, n, "beta1" in symbolic), factor(beta2, n, "beta2" in symbolic)
    lr_f = factor(lr, n, inputs)
    aten._foreach_add_.Scalar(state_steps, 1)  # step_t += 1
    # step = step_t.item(); the factors below are Python floats in eager: float64
    step = torch.stack(state_steps).to(torch.float64)
    bias_correction2 = 1 - torch.pow(b2, step)
    grads = decayed_grads(grads, params, lr, weight_decay, decoupled_weight_decay, maximize, dtype)
    # mu = beta1 * (1 - 0.5 * 0.96 ** (step * momentum_decay)), mu_next at step + 1
    mu = b1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))
    mu_next = b1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * momentum_decay))
    # mu_product *= mu: in the state's dtype, the number rounded to it
    aten._foreach_mul_.List(mu_products, one_each(mu, mu_products[0].dtype))
    moments_(exp_avgs, exp_avg_sqs, grads, b1, b2, dtype)
    # denom = exp_avg_sq.div(bias_correction2).sqrt(); denom.add_(eps)
    denom = aten._foreach_div.List(exp_avg_sqs, one_each(bias_correction2, dtype))
    denom = aten._foreach_add.Scalar(aten._foreach_sqrt.default(denom), eps)
    mu_product = torch.stack(mu_products).to(torch.float64)  # _get_value(mu_product)
    grad_value = -lr_f * (1.0 - mu) / (1.0 - mu_product)
    avg_value = (-lr_f * mu_next) / (1.0 - mu_product * mu_next)
    # param.addcdiv_(grad, denom, value=...); param.addcdiv_(exp_avg, denom, value=...):
    # p + (t * value) / denom, ATen's CPU order
    for tensors_, value in ((grads, grad_value), (exp_avgs, avg_value)):
        addcdiv_(params, tensors_, denom, value, dtype)


def nadam_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's NAdam loop is one :func:`nadam_form` computes exactly:
    six lists as ``torch.optim.nadam.nadam`` passes them, the rest by keyword."""
    numbers = ("weight_decay", "eps", "momentum_decay")
    lists = loop_lists(args, kwargs, 6, numbers, _FLAGS, _SCHEDULED)
    if lists is None:
        return False
    params, grads, exp_avgs, exp_avg_sqs, mu_products, steps = lists
    # the step counters and the mu products: the optimizer's scalar dtype, one for both
    return cpu_state(params + grads + exp_avgs + exp_avg_sqs, steps + mu_products)
