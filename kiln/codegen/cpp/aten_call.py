"""ATen calls of the C++ backend's executors, prepared once per graph node.

The Python executor (:mod:`kiln.codegen.cpp.executor`) spells a node's call out as source
(:func:`inline_call`) or binds it in a closure (:func:`prepared`); the native launcher
(:mod:`kiln.codegen.cpp.program`) calls the same ops through the c10 dispatcher and uses
:func:`prepared` only for nodes it has no native form for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir.graph import In, Node
from kiln.ir.semantics import call_node, resolve


def has_in(v: Any) -> bool:
    if isinstance(v, In):
        return True
    if isinstance(v, (tuple, list)):
        return any(has_in(x) for x in v)
    return False


def _filler(v: Any) -> Callable[[Sequence[Any]], Any]:
    """A function ``ins -> v with every In(k) replaced by ins[k]`` (for nested templates)."""
    if isinstance(v, In):
        k = v.k
        return lambda ins: ins[k]
    subs = [(_filler(x) if has_in(x) else None, x) for x in v]
    seq = type(v)
    return lambda ins: seq(x if f is None else f(ins) for f, x in subs)


def _view(x: torch.Tensor, shape: Any) -> torch.Tensor:
    """``x.view(shape)``; where a Kiln kernel gave ``x`` other strides than the traced graph
    assumed (its outputs are contiguous, eager keeps an input's permuted layout), the view can be
    impossible: the graph is functional, so a reshape (a copy) gives the same values."""
    try:
        return x.view(shape)
    except RuntimeError:
        if x.is_contiguous():
            raise  # not a layout difference: a real error of the graph
        return x.reshape(shape)


def _unit_last_stride(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.dim() and a.stride(-1) != 1 and a.size(-1) > 1:
        return a.contiguous()
    return a


def _contiguous(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and not a.is_contiguous():
        return a.contiguous()
    return a


# How an op's tensor arguments are prepared before the call, for ATen CPU kernels that give wrong
# numbers, silently, on layouts a Kiln graph can hand them (a Kiln kernel's output is contiguous
# where eager kept an input's permuted or channels-last layout, so an op can see a mix of layouts
# eager never gives it).  The code is what the native launcher gets (program.py, launcher.cpp).
UNIT_LAST = 1  # tensors whose last dim's stride is not 1 are copied (made contiguous)
CONTIGUOUS = 2  # every non-contiguous tensor is copied (made contiguous)
ARG_LAYOUT: dict[str, int] = {
    # the CPU flash-attention kernels read the last dim as if its stride were 1
    # (``sdp_utils_cpp`` sends such inputs to the math path, but only for the strides it sees at
    # trace time)
    "_scaled_dot_product_flash_attention_for_cpu.default": UNIT_LAST,
    "_scaled_dot_product_flash_attention_for_cpu_backward.default": UNIT_LAST,
    # group norm's backward reads dY in X's memory format: a channels-last X with a contiguous
    # dY (or the reverse) gives wrong gradients (torch 2.13; batch norm's, layer norm's, the
    # pooling and convolution backwards copy to one format themselves)
    "native_group_norm_backward.default": CONTIGUOUS,
}
_PREPARE: dict[int, Callable[[Any], Any]] = {UNIT_LAST: _unit_last_stride, CONTIGUOUS: _contiguous}


def _prepared_args_call(op: Callable, prepare: Callable[[Any], Any]) -> Callable:
    """``op`` with each argument passed through ``prepare`` first (see :data:`ARG_LAYOUT`)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(prepare(a) for a in args)
        kwargs = {k: prepare(v) for k, v in kwargs.items()}
        return op(*args, **kwargs)

    return call


# View ops called as Tensor methods: same ATen kernels, without the OpOverload Python dispatch
# (~5 us -> ~2 us a call; a transformer step runs a few hundred of them).
_METHODS: dict[str, Callable] = {
    "view.default": _view,
    "reshape.default": torch.Tensor.reshape,
    "permute.default": torch.Tensor.permute,
    "expand.default": torch.Tensor.expand,
    "unsqueeze.default": torch.Tensor.unsqueeze,
    "squeeze.dim": torch.Tensor.squeeze,
    "t.default": torch.Tensor.t,
    "transpose.int": torch.Tensor.transpose,
    "select.int": torch.Tensor.select,
}
for _op, _code in ARG_LAYOUT.items():
    _METHODS[_op] = _prepared_args_call(resolve(_op), _PREPARE[_code])


def prepare_aten_call(n: Node) -> Callable[[Sequence[Any]], Any]:
    """``ins -> result`` for a node whose arguments nest graph values (lists of tensors), which
    :func:`inline_call` cannot spell out: the op and the fill plan are worked out once."""
    fn = _METHODS.get(n.op) or resolve(n.op)
    template = list(n.args)
    direct = [(p, v.k) for p, v in enumerate(template) if isinstance(v, In)]
    nested = [
        (p, _filler(v)) for p, v in enumerate(template) if not isinstance(v, In) and has_in(v)
    ]
    kw_const = {k: v for k, v in n.kwargs if not has_in(v)}
    kw_fill = [(k, _filler(v)) for k, v in n.kwargs if has_in(v)]

    def call(ins: Sequence[Any]) -> Any:
        a = template.copy()
        for p, k in direct:
            a[p] = ins[k]
        for p, f in nested:
            a[p] = f(ins)
        kw = kw_const.copy() if kw_const else {}
        for k, f in kw_fill:
            kw[k] = f(ins)
        return fn(*a, **kw)

    return call


def inline_call(n: Node, i: int, inp: Sequence[int], ns: dict) -> str | None:
    """``OP(v3, A7_1, ...)``: node ``i``'s ATen call as Python source, its op and constant
    arguments bound in ``ns``; None when an argument nests graph values (lists of tensors)."""
    if any(not isinstance(v, In) and has_in(v) for v in n.args) or any(
        has_in(v) for _, v in n.kwargs
    ):
        return None
    try:
        ns[f"OP{i}"] = _METHODS.get(n.op) or resolve(n.op)
    except (AttributeError, KeyError):
        return None
    parts = []
    for p, v in enumerate(n.args):
        if isinstance(v, In):
            parts.append(f"v{inp[v.k]}")
        else:
            ns[f"A{i}_{p}"] = v
            parts.append(f"A{i}_{p}")
    if n.kwargs:
        ns[f"KW{i}"] = dict(n.kwargs)
        parts.append(f"**KW{i}")
    return f"OP{i}({', '.join(parts)})"


def prepared(n: Node) -> Callable[[Sequence[Any]], Any]:
    try:
        return prepare_aten_call(n)
    except (AttributeError, KeyError):  # unresolvable here: call_node reports it when run
        return lambda ins: call_node(n, ins)
