"""Eager-exact list forms of torch.optim's per-tensor update loops, traced in Kiln's frames:
Adam and AdamW, SGD, RMSprop, Adagrad, Adamax, Adadelta, NAdam and RAdam.

Why: on CPU, torch's default optimizer path is the per-tensor loop (``_single_tensor_adam``;
torch offers its foreach kernels only for accelerators), and Dynamo interprets that loop once per
parameter: ~20 ops a parameter, each with a fake-tensor evaluation and a graph node.  The tiny
GPT's AdamW frame (29 parameters) took 0.67 s of its 1.2 s warm first step, Llama's 0.53 of 1.5.
The form does the same work as list ops (``torch.ops.aten._foreach_*``: one traced op for all
parameters), which Kiln's foreach decomposition (``kiln/lowering/foreach.py``) spells out again
as the per-element ATen ops eager runs: the compiled graph holds the same per-parameter work.

Numbers: the form computes what *eager's* loop computes.  Dynamo traces the loop with
``capturable=True`` (its ``OptimizerVariable`` sets it for tracing), whose bias corrections are
float32 tensor math folded into the denominator, and it rewrites ``addcmul_`` into a fused
multiply-add; eager (``capturable=False``: on CPU eager refuses ``capturable=True``) computes the
bias corrections as Python floats (float64) and runs ATen's ``lerp_``/``mul_``/``addcmul_``/
``addcdiv_``.  The form runs those same ATen ops with the same Python-number arguments; the step
math in float64 tensors (the step counters stacked, ``1 - beta ** step``, ``lr / bc1``,
``sqrt(bc2)``), each result rounded to the parameters' dtype as ATen rounds a Python float
argument; ``addcdiv_(exp_avg, denom, value=v)`` as ``p + (exp_avg * v) / denom``, the order of
ATen's CPU kernel.  (Python's ``x ** 0.5`` and ``beta ** step`` call the C library's ``pow``;
ATen's double ``sqrt`` is exact and its ``pow`` within 1 ulp, so a float64 intermediate can
differ in its last bit; rounded to float32 that shows in about one value in 10^8.)

SGD (``_single_tensor_sgd``) has the same form: the same ATen ops (``mul_``/``add_`` on the
momentum buffers; on the first step the buffers are the gradients' clones, put in the list as
the loop does), bit for bit eager's.

Scheduled hyperparameters: once a scheduler has changed ``lr`` (any ``LRScheduler``), or the
momentum or ``beta1`` (``OneCycleLR``, ``CyclicLR``), Dynamo makes the number symbolic, and the
form is traced with those numbers as graph inputs (its ``symbolic`` names them,
``optimizer_form_args.factor``): float64 tensors, each use rounded to the parameters' dtype as
ATen rounds a Python float argument, ``add_(.., alpha=a)`` as one fused multiply-add as ATen's
kernel computes it.  Dynamo's trace of torch's loops passes them to ATen as Python numbers
(``alpha=``, ``value=``, ``lerp_``'s weight), so a scheduler that changes one every step had the
optimizer step compiled again at every step, up to Dynamo's recompile limit (and then run
uncompiled); with the forms it is compiled twice.  While the numbers are constants they stay
Python numbers in the graph (the per-parameter updates then fuse into one lane kernel,
``kiln/codegen/cpp/lanes.py``, which takes no broadcast inputs).

RMSprop, Adagrad, Adamax and Adadelta have forms of their own, in
:mod:`kiln.frontends.compile.optimizer_forms_adaptive` (Adagrad's decayed learning rate and
Adamax's bias correction in float64, as eager computes them); NAdam and RAdam in
:mod:`kiln.frontends.compile.optimizer_forms_adam_variants` (NAdam's momentum schedule and
RAdam's rectification in float64).

Used when (else Dynamo traces torch's loop, as before): the frame is compiled by Kiln's backend,
every tensor is on the CPU, parameters and gradients share one dtype, no complex parameters, not
``differentiable``, no grad scaler, ``lr``, the momentum and the betas Python numbers (constants,
or floats Dynamo made symbolic).  Counted as
``optimizer_forms_traced`` (the form taken) and ``optimizer_forms_declined`` (the loop traced).
:func:`install` wraps Dynamo's ``inline_user_function_return`` (torch 2.13's own, once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import adadelta as _torch_adadelta
from torch.optim import adagrad as _torch_adagrad
from torch.optim import adam as _torch_adam
from torch.optim import adamax as _torch_adamax
from torch.optim import nadam as _torch_nadam
from torch.optim import radam as _torch_radam
from torch.optim import rmsprop as _torch_rmsprop
from torch.optim import sgd as _torch_sgd

from kiln import metrics
from kiln.frontends.compile.optimizer_form_args import (
    addcdiv_,
    added_scaled,
    constant,
    constants,
    cpu_one_dtype,
    cpu_state,
    decayed_grads,
    factor,
    l2_grads,
    moments_,
    multiplied_,
    negated_lr,
    number,
    one_each,
    plain_numbers,
    plus_scaled,
    tensors,
)
from kiln.frontends.compile.optimizer_forms_adam_variants import (
    nadam_form,
    nadam_takes,
    radam_form,
    radam_takes,
)
from kiln.frontends.compile.optimizer_forms_adaptive import (
    adadelta_form,
    adadelta_takes,
    adagrad_form,
    adagrad_takes,
    adamax_form,
    adamax_takes,
    rmsprop_form,
    rmsprop_takes,
)
from kiln.frontends.compile.torch_wrap import defined_in, wrap_once

aten = torch.ops.aten


def adam_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    grad_scale: None = None,
    found_inf: None = None,
    *,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled_weight_decay: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.adam._single_tensor_adam`` (Adam and AdamW) as list ops, with eager's
    numbers; only what :func:`_adam_takes` accepts reaches it (``symbolic``: the betas as
    ``factor`` vectors)."""
    dtype = params[0].dtype
    n = len(params)
    b1, b2 = factor(beta1, n, "beta1" in symbolic), factor(beta2, n, "beta2" in symbolic)
    # lr as a float64 tensor: where Dynamo made it symbolic (a scheduler changed it), its uses
    # below are tensor ops, which the graph takes as an input instead of specializing each value
    lr_t = torch.ones((), dtype=torch.float64) * lr
    aten._foreach_add_.Scalar(state_steps, 1)  # step_t += 1
    grads = decayed_grads(grads, params, lr, weight_decay, decoupled_weight_decay, maximize, dtype)
    moments_(exp_avgs, exp_avg_sqs, grads, b1, b2, dtype)
    # step = step_t.item(); the bias corrections as Python floats: float64
    step = torch.stack(state_steps).to(torch.float64)
    bias_correction1 = 1 - torch.pow(b1, step)
    bias_correction2 = 1 - torch.pow(b2, step)
    neg_step_size = torch.div(lr_t, bias_correction1).neg()
    bias_correction2_sqrt = bias_correction2.sqrt()
    second = exp_avg_sqs
    if amsgrad:
        # torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
        aten._foreach_maximum_.List(max_exp_avg_sqs, exp_avg_sqs)
        second = max_exp_avg_sqs
    # denom = (second.sqrt() / bias_correction2_sqrt).add_(eps)
    denom = aten._foreach_sqrt.default(second)
    denom = aten._foreach_div.List(denom, one_each(bias_correction2_sqrt, dtype))
    denom = aten._foreach_add.Scalar(denom, eps)
    # param.addcdiv_(exp_avg, denom, value=-step_size): param + (-step_size * exp_avg) / denom
    addcdiv_(params, exp_avgs, denom, neg_step_size, dtype)


_FLAGS = (
    "grad_scale",
    "found_inf",
    "has_complex",
    "differentiable",
    "amsgrad",
    "maximize",
    "decoupled_weight_decay",
)
_NUMBERS = ("lr", "beta1", "beta2", "weight_decay", "eps")


def _adam_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's Adam loop is one :func:`adam_form` computes exactly:
    the arguments as ``torch.optim.adam.adam`` passes them (six lists, the rest by keyword)."""
    if len(args) != 6:
        return False
    consts = constants(kwargs, _FLAGS)
    if consts is None:
        return False
    if consts["grad_scale"] is not None or consts["found_inf"] is not None:
        return False
    if consts["has_complex"] or consts["differentiable"]:
        return False
    if not all(name in kwargs and number(kwargs[name]) for name in _NUMBERS):
        return False
    lists = [tensors(a) for a in args]
    if any(t is None for t in lists):
        return False
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
    if not params or len({len(params), len(grads), len(exp_avgs), len(steps)}) != 1:
        return False
    if consts["amsgrad"] and len(max_exp_avg_sqs) != len(params):
        return False
    return cpu_state(params + grads + exp_avgs + exp_avg_sqs + max_exp_avg_sqs, steps)


def sgd_form(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffer_list: list[torch.Tensor | None],
    grad_scale: None = None,
    found_inf: None = None,
    *,
    weight_decay: float,
    momentum: float,
    lr: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    symbolic: tuple[str, ...] = (),
    **unused: Any,
) -> None:
    """``torch.optim.sgd._single_tensor_sgd`` as list ops, with eager's numbers; only what
    :func:`_sgd_takes` accepts reaches it (``symbolic``: ``lr`` and the momentum as ``factor``
    vectors)."""
    inputs = bool(symbolic)  # a number a scheduler changes is a graph input
    dtype = params[0].dtype
    grads = l2_grads(grads, params, maximize, weight_decay)
    if momentum_buffer_list:  # momentum != 0: torch.optim lists the buffers only then
        m = factor(momentum, len(params), "momentum" in symbolic)
        if momentum_buffer_list[0] is None:
            # the first step: buf = grad.detach().clone(), kept in the list for the state
            for i, g in enumerate(grads):
                momentum_buffer_list[i] = g.detach().clone()
        else:
            # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            multiplied_(momentum_buffer_list, m, dtype)
            aten._foreach_add_.List(momentum_buffer_list, grads, alpha=1 - dampening)
        if nesterov:
            grads = plus_scaled(grads, momentum_buffer_list, m, dtype)
        else:
            grads = momentum_buffer_list
    # param.add_(grad, alpha=-lr)
    added_scaled(params, grads, negated_lr(lr, len(params), inputs), dtype)


def _sgd_takes(args: list[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a traced call of torch's SGD loop is one :func:`sgd_form` computes exactly: the
    arguments as ``torch.optim.sgd.sgd`` passes them (three lists, the rest by keyword), the
    momentum buffers all unset (the first step) or all tensors."""
    if len(args) != 3:
        return False
    # the form branches on weight_decay and dampening: constants, numbers; the momentum a number
    # (a scheduler may change it: symbolic)
    numbers = ("weight_decay", "dampening")
    consts = constants(
        kwargs, ("grad_scale", "found_inf", "has_sparse_grad", "nesterov", "maximize") + numbers
    )
    if consts is None:
        return False
    if consts["grad_scale"] is not None or consts["found_inf"] is not None:
        return False
    if consts["has_sparse_grad"]:
        return False
    if not plain_numbers(consts, numbers):
        return False
    if not all(name in kwargs and number(kwargs[name]) for name in ("lr", "momentum")):
        return False
    params, grads = tensors(args[0]), tensors(args[1])
    if not params or grads is None or len(params) != len(grads):
        return False
    buffers = getattr(args[2], "items", None)
    if not isinstance(buffers, list):
        return False
    known, momentum = constant(kwargs["momentum"])
    if known and momentum == 0:
        buffers = []  # no buffers: torch's step() lists none without momentum
    elif len(buffers) != len(params):
        return False
    unset = [constant(b) == (True, None) for b in buffers]
    if any(unset) and not all(unset):
        return False
    state = [] if all(unset) else tensors(args[2])
    if state is None:
        return False
    return cpu_one_dtype(params + grads + state, params[0].dtype)


# torch's loop -> (whether the form takes the call, the form; the hyperparameters Dynamo made
# symbolic, a scheduler's, reach it named in ``symbolic`` and become graph inputs)
FORMS: dict[Callable[..., Any], tuple[Callable[..., bool], Callable[..., Any]]] = {
    _torch_adam._single_tensor_adam: (_adam_takes, adam_form),
    _torch_sgd._single_tensor_sgd: (_sgd_takes, sgd_form),
    _torch_rmsprop._single_tensor_rmsprop: (rmsprop_takes, rmsprop_form),
    _torch_adagrad._single_tensor_adagrad: (adagrad_takes, adagrad_form),
    _torch_adamax._single_tensor_adamax: (adamax_takes, adamax_form),
    _torch_adadelta._single_tensor_adadelta: (adadelta_takes, adadelta_form),
    _torch_nadam._single_tensor_nadam: (nadam_takes, nadam_form),
    _torch_radam._single_tensor_radam: (radam_takes, radam_form),
}


# what schedulers change (``LRScheduler``: lr; ``OneCycleLR``/``CyclicLR``: the momentum or beta1)
_SCHEDULED = ("lr", "beta1", "beta2", "momentum")


def _wrap(original: Callable[..., Any], is_ours: Callable[[Any], bool]) -> Callable[..., Any]:
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.functions import UserFunctionVariable

    @functools.wraps(original)
    def inline_user_function_return(
        self: Any, fn: Any, args: Any, kwargs: Any, *rest: Any, **kw: Any
    ) -> Any:
        entry = FORMS.get(getattr(fn, "fn", None)) if type(fn) is UserFunctionVariable else None
        if entry is not None and is_ours(getattr(self.output, "compiler_fn", None)):
            takes, form = entry
            if takes(args, kwargs):
                metrics.incr("optimizer_forms_traced")
                # the numbers Dynamo made symbolic: graph inputs; the others stay constants
                symbolic = tuple(
                    n for n in _SCHEDULED if n in kwargs and not constant(kwargs[n])[0]
                )
                fn = UserFunctionVariable(form)
                kwargs = {**kwargs, "symbolic": ConstantVariable.create(symbolic)}
            else:
                metrics.incr("optimizer_forms_declined")
        return original(self, fn, args, kwargs, *rest, **kw)

    return inline_user_function_return


def install(is_ours: Callable[[Any], bool]) -> bool:
    """Wrap Dynamo's ``inline_user_function_return`` (once per process); whether it is in place."""
    from torch._dynamo import symbolic_convert

    return wrap_once(
        symbolic_convert.InstructionTranslatorBase,
        "inline_user_function_return",
        lambda original: _wrap(original, is_ours),
        defined_in(symbolic_convert.__name__),
    )
