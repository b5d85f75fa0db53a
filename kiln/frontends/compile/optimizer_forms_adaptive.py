"""List forms of torch.optim's per-tensor RMSprop, Adagrad, Adamax and Adadelta loops, with eager's
numbers.

What a form is, why Kiln traces one and where (Kiln's frames only, CPU tensors of one dtype):
:mod:`kiln.frontends.compile.optimizer_forms`, which holds the table these three join, and how
a hyperparameter a scheduler changes becomes a graph input (a form's ``symbolic`` names).

RMSprop (``_single_tensor_rmsprop``) has no step-dependent factor: the form runs the loop's
ATen ops with the loop's Python-number arguments (``mul_``/``addcmul_`` on the square averages,
``lerp_`` and ``addcmul`` for the centered variance, ``sqrt``, ``add_(eps)``, the momentum
buffers' ``mul_``/``addcdiv_``).  ``addcdiv_(g, avg, value=-lr)`` is spelled
``p + (g * -lr) / avg``, the order of ATen's CPU kernel (torch's decomposition of ``addcdiv``
divides first).

Adagrad (``_single_tensor_adagrad``, dense gradients) divides the learning rate by
``1 + (step - 1) * lr_decay`` with ``step`` a Python float in eager (``step_t.item()``); Dynamo's
trace of the loop computes it in float32 tensor math.  The form computes it in float64, as eager
does, then rounds ``-clr`` to the parameters' dtype for the ``addcdiv_``.

Adamax (``_single_tensor_adamax``) divides by ``1 - beta1 ** step`` with ``step`` a Python
float in eager; Dynamo traces the loop's ``capturable`` branch, float32 tensor math.  The form
computes it in float64, as eager does, and runs the loop's ``lerp_``, ``mul_``, ``abs``,
``add_(eps)``, ``maximum`` and ``addcdiv_`` (in ATen's CPU order).

Adadelta (``_single_tensor_adadelta``) has no step-dependent factor either: the form runs the
loop's ``mul_``/``addcmul_`` on both running averages, ``add(eps).sqrt_()`` twice, ``div_``,
``mul_`` and ``add_(delta, alpha=-lr)``; its use is the scheduled ``lr`` (a graph input once a
scheduler changed it: Dynamo's trace of the loop was compiled again for every value).

Taken only where the form is exact: the loop's arguments as ``torch.optim`` passes them, numbers
Dynamo knows as constants (``lr``, the momentum and the betas may also be symbolic floats), no
complex parameters, not ``differentiable``, no sparse gradients or grad scaler (Adagrad); else
Dynamo traces torch's loop.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.frontends.compile.optimizer_form_args import (
    addcdiv_,
    added_scaled,
    constant,
    constants,
    cpu_state,
    factor,
    l2_grads,
    lerped_,
    loop_lists,
    multiplied_,
    negated_lr,
    number,
    plain_numbers,
    tensors,
)

aten = torch.ops.aten


def rmsprop_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    square_avgs: list[torch.Tensor],
    grad_avgs: list[torch.Tensor],
    momentum_buffer_list: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.rmsprop._single_tensor_rmsprop`` as list ops, with eager's numbers; only
    what :func:`rmsprop_takes` accepts reaches it (``symbolic``: ``lr`` and the momentum as
    ``factor`` vectors)."""
    inputs = bool(symbolic)  # a number a scheduler changes is a graph input
    dtype = params[0].dtype
    neg_lr = negated_lr(lr, len(params), inputs)
    aten._foreach_add_.Scalar(state_steps, 1)  # step += 1
    grads = l2_grads(grads, params, maximize, weight_decay)
    # square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
    aten._foreach_mul_.Scalar(square_avgs, alpha)
    aten._foreach_addcmul_.Scalar(square_avgs, grads, grads, 1 - alpha)
    if centered:
        aten._foreach_lerp_.Scalar(grad_avgs, grads, 1 - alpha)  # grad_avg.lerp_(grad, 1 - alpha)
        # avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        avg = aten._foreach_addcmul.Scalar(square_avgs, grad_avgs, grad_avgs, -1)
        avg = aten._foreach_sqrt.default(avg)
    else:
        avg = aten._foreach_sqrt.default(square_avgs)  # avg = square_avg.sqrt()
    avg = aten._foreach_add.Scalar(avg, eps)  # avg.add_(eps)
    if momentum_buffer_list:  # momentum > 0: torch.optim lists the buffers only then
        # buf.mul_(momentum).addcdiv_(grad, avg): value 1, so p + g / avg
        m = factor(momentum, len(params), "momentum" in symbolic)
        multiplied_(momentum_buffer_list, m, dtype)
        addcdiv_(momentum_buffer_list, grads, avg, 1, dtype)
        added_scaled(params, momentum_buffer_list, neg_lr, dtype)  # param.add_(buf, alpha=-lr)
    else:
        # param.addcdiv_(grad, avg, value=-lr)
        addcdiv_(params, grads, avg, neg_lr, dtype)


def rmsprop_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's RMSprop loop is one :func:`rmsprop_form` computes
    exactly: six lists as ``torch.optim.rmsprop.rmsprop`` passes them, the rest by keyword."""
    if len(args) != 6:
        return False
    numbers = ("alpha", "eps", "weight_decay")
    consts = constants(kwargs, numbers + ("centered", "maximize", "differentiable", "has_complex"))
    if consts is None or consts["differentiable"] or consts["has_complex"]:
        return False
    if not plain_numbers(consts, numbers):
        return False
    # lr and the momentum numbers (a scheduler may change them: symbolic)
    if not all(name in kwargs and number(kwargs[name]) for name in ("lr", "momentum")):
        return False
    known, momentum = constant(kwargs["momentum"])
    with_momentum = not known or momentum > 0
    lists = [tensors(a) for a in args]
    if any(t is None for t in lists):
        return False
    params, grads, square_avgs, grad_avgs, buffers, steps = lists
    n = len(params)
    if not n or len(grads) != n or len(square_avgs) != n or len(steps) != n:
        return False
    if len(grad_avgs) != (n if consts["centered"] else 0):
        return False
    if len(buffers) != (n if with_momentum else 0):
        return False
    return cpu_state(params + grads + square_avgs + grad_avgs + buffers, steps)


def adagrad_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    grad_scale: None = None,
    found_inf: None = None,
    *,
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.adagrad._single_tensor_adagrad`` (dense gradients) as list ops, with
    eager's numbers; only what :func:`adagrad_takes` accepts reaches it (``symbolic``: ``lr`` as
    a ``factor`` vector)."""
    inputs = bool(symbolic)  # a number a scheduler changes is a graph input
    dtype = params[0].dtype
    aten._foreach_add_.Scalar(state_steps, 1)  # step_t += 1
    grads = l2_grads(grads, params, maximize, weight_decay)
    if lr_decay == 0 and not inputs:
        neg_clr = -lr  # lr / (1 + (step - 1) * 0) is lr itself
    else:
        # step = step_t.item(); clr = lr / (1 + (step - 1) * lr_decay): Python floats, float64
        step = torch.stack(state_steps).to(torch.float64)
        lr_t = torch.ones((), dtype=torch.float64) * lr
        neg_clr = (lr_t / (1 + (step - 1) * lr_decay)).neg()
    aten._foreach_addcmul_.Scalar(state_sums, grads, grads, 1)  # state_sum.addcmul_(grad, grad)
    std = aten._foreach_sqrt.default(state_sums)  # std = state_sum.sqrt().add_(eps)
    std = aten._foreach_add.Scalar(std, eps)
    addcdiv_(params, grads, std, neg_clr, dtype)  # param.addcdiv_(grad, std, value=-clr)


def adagrad_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's Adagrad loop is one :func:`adagrad_form` computes
    exactly: four lists as ``torch.optim.adagrad.adagrad`` passes them, the rest by keyword,
    dense gradients, no grad scaler."""
    if len(args) != 4:
        return False
    names = ("weight_decay", "lr_decay", "eps")
    consts = constants(
        kwargs,
        names
        + ("maximize", "differentiable", "has_complex", "has_sparse_grad")
        + ("grad_scale", "found_inf"),
    )
    if consts is None or consts["differentiable"] or consts["has_complex"]:
        return False
    if consts["has_sparse_grad"] or consts["grad_scale"] is not None:
        return False
    if consts["found_inf"] is not None:
        return False
    if not plain_numbers(consts, names):
        return False
    if "lr" not in kwargs or not number(kwargs["lr"]):
        return False
    lists = [tensors(a) for a in args]
    if any(t is None for t in lists):
        return False
    params, grads, state_sums, steps = lists
    if not params or len({len(params), len(grads), len(state_sums), len(steps)}) != 1:
        return False
    return cpu_state(params + grads + state_sums, steps)


def adamax_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_infs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    eps: float,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.adamax._single_tensor_adamax`` as list ops, with eager's numbers; only what
    :func:`adamax_takes` accepts reaches it (``symbolic``: ``lr`` and the betas as ``factor``
    vectors)."""
    dtype = params[0].dtype
    n = len(params)
    b1, b2 = factor(beta1, n, "beta1" in symbolic), factor(beta2, n, "beta2" in symbolic)
    aten._foreach_add_.Scalar(state_steps, 1)  # step_t += 1
    grads = l2_grads(grads, params, maximize, weight_decay)
    lerped_(exp_avgs, grads, 1 - b1, dtype)  # exp_avg.lerp_(grad, 1 - beta1)
    # torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)
    multiplied_(exp_infs, b2, dtype)
    norms = aten._foreach_add.Scalar(aten._foreach_abs.default(grads), eps)
    aten._foreach_maximum_.List(exp_infs, norms)
    # bias_correction = 1 - beta1 ** step.item(); clr = lr / bias_correction: float64
    step = torch.stack(state_steps).to(torch.float64)
    lr_t = torch.ones((), dtype=torch.float64) * lr
    neg_clr = (lr_t / (1 - torch.pow(b1, step))).neg()
    # param.addcdiv_(exp_avg, exp_inf, value=-clr)
    addcdiv_(params, exp_avgs, exp_infs, neg_clr, dtype)


def adamax_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's Adamax loop is one :func:`adamax_form` computes exactly:
    five lists as ``torch.optim.adamax.adamax`` passes them, the rest by keyword."""
    flags = ("maximize", "differentiable", "has_complex")
    lists = loop_lists(args, kwargs, 5, ("eps", "weight_decay"), flags, ("lr", "beta1", "beta2"))
    if lists is None:
        return False
    params, grads, exp_avgs, exp_infs, steps = lists
    return cpu_state(params + grads + exp_avgs + exp_infs, steps)


def adadelta_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    square_avgs: list[torch.Tensor],
    acc_deltas: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.adadelta._single_tensor_adadelta`` as list ops, with eager's numbers; only
    what :func:`adadelta_takes` accepts reaches it (``symbolic``: ``lr`` as a ``factor``
    vector)."""
    inputs = bool(symbolic)  # a number a scheduler changes is a graph input
    dtype = params[0].dtype
    aten._foreach_add_.Scalar(state_steps, 1)  # step += 1
    grads = l2_grads(grads, params, maximize, weight_decay)
    # square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho)
    aten._foreach_mul_.Scalar(square_avgs, rho)
    aten._foreach_addcmul_.Scalar(square_avgs, grads, grads, 1 - rho)
    # std = square_avg.add(eps).sqrt_(); delta = acc_delta.add(eps).sqrt_()
    std = aten._foreach_sqrt.default(aten._foreach_add.Scalar(square_avgs, eps))
    delta = aten._foreach_sqrt.default(aten._foreach_add.Scalar(acc_deltas, eps))
    # delta.div_(std).mul_(grad)
    delta = aten._foreach_mul.List(aten._foreach_div.List(delta, std), grads)
    # acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
    aten._foreach_mul_.Scalar(acc_deltas, rho)
    aten._foreach_addcmul_.Scalar(acc_deltas, delta, delta, 1 - rho)
    # param.add_(delta, alpha=-lr)
    added_scaled(params, delta, negated_lr(lr, len(params), inputs), dtype)


def adadelta_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's Adadelta loop is one :func:`adadelta_form` computes
    exactly: five lists as ``torch.optim.adadelta.adadelta`` passes them, the rest by keyword."""
    flags = ("maximize", "differentiable", "has_complex")
    lists = loop_lists(args, kwargs, 5, ("rho", "eps", "weight_decay"), flags, ("lr",))
    if lists is None:
        return False
    params, grads, square_avgs, acc_deltas, steps = lists
    return cpu_state(params + grads + square_avgs + acc_deltas, steps)
