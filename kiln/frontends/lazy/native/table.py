"""The native recorder's op table (stage 1): the ATen overloads it records.

Each entry gets the recorder's boxed kernel on the PrivateUse2 dispatch key.  Ops with a
CompositeImplicitAutograd kernel (``reshape``, ``matmul``) are not listed: PyTorch decomposes them
before they reach a backend key, into ops listed here (``view``, ``clone``, ``_unsafe_view``,
``mm``, ``bmm``, ``expand``).  ``STRUCTURAL`` ops keep their Python floats in the node (as the
Python recorder's ``_STRUCTURAL_FLOATS``: ``pow(x, 2.0)`` stays visible to passes); every other
Python float is lifted into a scalar graph input.
"""

from __future__ import annotations

import torch

from kiln.frontends.lazy.foreach import split_of
from kiln.frontends.lazy.tensor import _STRUCTURAL_FLOATS, _facts
from kiln.frontends.lazy.tensor import FILLS as _FILLS

UNARY = [
    "abs.default",
    "neg.default",
    "exp.default",
    "log.default",
    "sqrt.default",
    "rsqrt.default",
    "relu.default",
    "sigmoid.default",
    "tanh.default",
    "sin.default",
    "cos.default",
    "reciprocal.default",
    "gelu.default",
    "silu.default",
    "clone.default",
]
BINARY = [f"{op}.{ov}" for op in ("add", "sub", "mul", "div") for ov in ("Tensor", "Scalar")] + [
    "div.Tensor_mode",
    "maximum.default",
    "minimum.default",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    *(f"{op}.{ov}" for op in ("gt", "lt", "ge", "le", "eq", "ne") for ov in ("Tensor", "Scalar")),
    "where.self",
]
MATMUL = ["mm.default", "addmm.default", "bmm.default", "mv.default"]
REDUCTIONS = ["sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "amax.default"]
# view ops (aliasing results): recorded as view links; _unsafe_view is a plain node (no alias)
VIEWS = [
    "view.default",
    "_reshape_alias.default",
    "transpose.int",
    "t.default",
    "permute.default",
    "expand.default",
    "unsqueeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "select.int",
    "slice.Tensor",
    "diagonal.default",
    "unfold.default",
]
OTHER = ["_unsafe_view.default"]
# what the optimizers' foreach ops split into beyond the ops above (foreach.h)
OPTIMIZER = ["lerp.Scalar", "lerp.Tensor", "addcmul.default", "addcdiv.default"]

# ops of a training step's forward and backward (softmax / log-softmax, GELU's
# backward, the NLL loss's backward, embedding, the causal mask's masked_fill), recorded by the
# Python fallback as one plain node each before (no Kiln decomposition, no special path)
TRAINING = [
    "_softmax.default",
    "_softmax_backward_data.default",
    "_log_softmax.default",
    "_log_softmax_backward_data.default",
    "gelu_backward.default",
    "silu_backward.default",
    "nll_loss_backward.default",
    "embedding.default",
    "embedding_dense_backward.default",
    "masked_fill.Scalar",
    "bitwise_not.default",
    # several outputs: one getitem node each (an absent output: the Python fallback)
    "native_layer_norm.default",
    "native_layer_norm_backward.default",
    "nll_loss_forward.default",
]

# ops of the transformers models' steps (GPT-2, BERT, Llama with their default SDPA attention)
# that the Python fallback recorded as one plain node each, ~10-60 us a call in Python: factories
# of a tensor's options, the scatters indexing's gradients make, padding, the causal mask's
# `all`, SDPA's forward and backward.  (`cumsum`,
# once a step, stays with the Python fallback: the fallback's tests take it as their op outside
# the table)
MODELS = [
    "new_zeros.default",
    "empty_like.default",
    "fill.Scalar",
    "slice_scatter.default",
    "select_scatter.default",
    "constant_pad_nd.default",
    "all.default",
    "_scaled_dot_product_flash_attention_for_cpu_backward.default",
    # torch tags it random (its dropout), but Kiln lowers it as a plain node whatever its
    # dropout_p, as the Python fallback's rng.record does (``is_random_node``: never seeded)
    "_scaled_dot_product_flash_attention_for_cpu.default",
    # recorded as torch's decomposition of them (new_zeros + slice/select_scatter), in C++
    "slice_backward.default",
    "select_backward.default",
]

# more ops of the workloads' steps the Python fallback recorded as one plain node each: tensor
# lists (`cat`, `stack`: every element a node input), GELU-tanh's and ReLU's backward, `gather`,
# the convolutions and max pooling (forward and backward) of a CNN, dtype casts on the device
# (`_to_copy` with no `device=`: with one, the Python fallback takes it), the fills of a
# pending value (of a tensor holding data they are made as data: FILLS below), and the splits
MORE = [
    "cat.default",
    "stack.default",
    "tanh_backward.default",
    "threshold_backward.default",
    "gather.default",
    "convolution.default",
    "convolution_backward.default",
    "max_pool2d_with_indices.default",
    "max_pool2d_with_indices_backward.default",
    "_to_copy.default",
    "zeros_like.default",
    "ones_like.default",
    "full_like.default",
    # one view per piece (narrow / select: table views), as the Python fallback's _SPLIT_VIEWS
    "split.Tensor",
    "split_with_sizes.default",
    "unbind.int",
    # a padding mask's ops in transformers' masking utilities (BERT, DistilBERT with
    # attention_mask)
    "new_ones.default",
    "new_full.default",
    "bitwise_and.Tensor",
    "bitwise_or.Tensor",
]

OPS = UNARY + BINARY + MATMUL + REDUCTIONS + VIEWS + OTHER + OPTIMIZER + TRAINING + MODELS + MORE
# ops whose Python floats stay in the node: the Python recorder's own set (pow's exponent,
# masked_fill's value, the norms' eps, ...), so both recorders build the same nodes
STRUCTURAL = sorted(_STRUCTURAL_FLOATS)
# ops the Python fallback makes as data when their tensor holds data (lazy/tensor.py's FILLS)
FILLS = sorted(f"{f._schema.name[6:]}.{f._overloadname}" for f in _FILLS)


def foreach_splits() -> list[tuple[str, str, bool]]:
    """(foreach overload, per-tensor overload, in-place) for every ``_foreach_*`` overload that
    ``lazy/foreach.py`` records as per-tensor ops (in-place ones through their functional
    variant), as "name.overload": the recorder records these in C++ (``foreach.h``)."""
    out = []
    for name in dir(torch.ops.aten):
        if not name.startswith("_foreach_"):
            continue
        packet = getattr(torch.ops.aten, name)
        for ov in packet.overloads():
            func = getattr(packet, ov)
            if ov.endswith("out"):
                continue
            inplace = name.endswith("_")
            functional = _facts(func).functional if inplace else func
            split = split_of(functional) if functional is not None else None
            if split is None:
                continue
            per = split.op
            out.append((f"{name}.{ov}", f"{per._schema.name[6:]}.{per._overloadname}", inplace))
    return out


_COMPARISONS = {"gt", "lt", "ge", "le", "eq", "ne"}


def inplace_pairs() -> list[tuple[str, str]]:
    """(in-place overload, its functional table op) for every table op (views aside) with an
    in-place variant writing its first argument only, as "name.overload": the recorder records
    these in C++ as the functional op and a write-back (``inplace.h``)."""
    out = []
    for full in OPS:
        if full in VIEWS:
            continue
        name, ov = full.split(".")
        if name in _COMPARISONS:
            continue  # (a bool result: cast back to the tensor's dtype by the Python fallback)
        packet = getattr(torch.ops.aten, name + "_", None)
        if packet is None or ov not in packet.overloads():
            continue
        func = getattr(packet, ov)
        facts = _facts(func)
        if facts.functional is None or facts.inplace_view or list(facts.mutated) != [0]:
            continue
        fn = facts.functional
        if f"{fn._schema.name[6:]}.{fn._overloadname}" != full:
            continue
        out.append((f"{name}_.{ov}", full))
    return out
