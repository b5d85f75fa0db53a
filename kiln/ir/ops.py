"""The Kiln op set: every op a graph may hold, with the category passes reason about.

Kiln ops are named after the core ATen ops they mean (``add.Tensor``, ``mm.default``), so the
reference interpreter can run any of them through ATen, and the code generator can pick the ones it
fuses by category.  A handful of ops are Kiln's own:

  input        a tensor the caller passes in                 (attrs: index)
  scalar       a Python number lifted into a graph input     (attrs: index) - never baked in
  constant     a small tensor captured at trace time         (attrs: value)
  getitem      element ``index`` of a multi-output node
  pyop         integer arithmetic on sizes (``pyop.mul``): dynamic-shape bookkeeping
  opaque       an ATen op Kiln has no rule for: runs eagerly, counted as a fallback
  fused        a kernel built by the fusion pass (attrs: kernel)
  writeback    ``writeback(dst, src)``: store ``src`` into graph input ``dst`` (an in-place update
               the caller asked for, e.g. a parameter after the optimizer step); returns ``dst``.
               The memory planner may let the kernel that computes ``src`` write into ``dst``
               directly, and then nothing is copied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Category(enum.Enum):
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    VIEW = "view"  # view / layout: no data is computed, only indexing changes
    MATMUL = "matmul"  # matmul and convolution: extern GEMM kernels
    DATA_MOVEMENT = "data_movement"  # copies, gathers, scatters, concatenation, padding
    RANDOM = "random"  # takes its seed as a graph input
    COLLECTIVE = "collective"
    FACTORY = "factory"  # makes a tensor from nothing but sizes
    OPAQUE = "opaque"  # run eagerly by ATen, never looked into
    META = "meta"  # graph plumbing: input, scalar, constant, getitem


@dataclass(frozen=True)
class OpDef:
    name: str  # ATen packet name, e.g. "add" (the overload is kept on the node)
    category: Category


_E = Category.ELEMENTWISE
_R = Category.REDUCTION
_V = Category.VIEW
_M = Category.MATMUL
_D = Category.DATA_MOVEMENT
_X = Category.RANDOM
_F = Category.FACTORY

_TABLE: dict[Category, str] = {
    _E: """
    abs acos acosh add addcdiv addcmul asin asinh atan atan2 atanh bitwise_and bitwise_not
    bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift ceil clamp clamp_min clamp_max
    clone copy cos cosh digamma div elu eq erf erfc erfinv exp exp2 expm1 fill floor floor_divide
    fmod frac ge gelu gelu_backward gt hardtanh hardsigmoid hardswish isinf isnan le leaky_relu lerp
    lgamma log log10 log1p log2 logical_and logical_not logical_or logical_xor lt masked_fill
    maximum minimum mish mul ne neg nan_to_num pow reciprocal relu remainder round rsqrt
    sigmoid sigmoid_backward sign signbit silu sin sinh sqrt sub tan tanh tanh_backward threshold
    threshold_backward trunc where _to_copy to_copy heaviside hypot nextafter igamma igammac
    logit xlogy special_xlog1py copysign fmax fmin sgn softplus softplus_backward
    elu_backward leaky_relu_backward hardtanh_backward silu_backward mish_backward
    hardswish_backward hardsigmoid_backward square i0 polygamma log_sigmoid_forward zero
    _foreach_add _foreach_sub _foreach_mul _foreach_div _foreach_addcdiv _foreach_addcmul
    _foreach_lerp _foreach_sqrt _foreach_neg _foreach_abs _foreach_exp _foreach_reciprocal
    _foreach_copy _foreach_maximum _foreach_minimum _foreach_clamp_min _foreach_clamp_max
    _foreach_pow _foreach_sign _foreach_zero _foreach_rsqrt _foreach_log
    """,
    _R: """
    sum mean amax amin max min argmax argmin prod var var_mean std std_mean any all logsumexp
    _softmax _log_softmax _softmax_backward_data _log_softmax_backward_data native_layer_norm
    native_layer_norm_backward native_batch_norm native_batch_norm_backward
    _native_batch_norm_legit _native_batch_norm_legit_no_training
    _native_batch_norm_legit_functional native_group_norm native_group_norm_backward
    cumsum cumprod norm linalg_vector_norm nll_loss_forward nll_loss_backward nll_loss2d_forward
    nll_loss2d_backward mse_loss mse_loss_backward binary_cross_entropy
    binary_cross_entropy_backward _fused_rms_norm cummax cummin logcumsumexp sort topk
    _foreach_norm
    """,
    _V: """
    view _unsafe_view reshape expand permute transpose t squeeze unsqueeze select slice
    as_strided alias detach diagonal unfold split split_with_sizes unbind narrow movedim
    view_as_real view_as_complex lift_fresh _reshape_alias chunk expand_as
    """,
    _M: """
    mm addmm bmm baddbmm matmul convolution convolution_backward _scaled_mm linear addmv mv dot
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
    """,
    _D: """
    cat stack index index_select gather scatter scatter_add scatter_reduce index_put index_add
    embedding embedding_dense_backward constant_pad_nd slice_scatter select_scatter
    as_strided_scatter diagonal_scatter flip roll repeat tril triu masked_scatter
    index_copy take_along_dim _unsafe_index _unsafe_index_put pad reflection_pad1d
    reflection_pad2d replication_pad1d replication_pad2d upsample_nearest2d upsample_bilinear2d
    avg_pool2d avg_pool2d_backward max_pool2d_with_indices max_pool2d_with_indices_backward
    _adaptive_avg_pool2d _adaptive_avg_pool2d_backward col2im im2col contiguous
    """,
    _X: """
    rand randn rand_like randn_like randint randint_like bernoulli native_dropout uniform normal
    randperm multinomial exponential geometric cauchy log_normal normal_functional random
    """,
    _F: """
    empty empty_strided empty_like zeros zeros_like ones ones_like full full_like arange
    linspace logspace eye scalar_tensor new_empty new_zeros new_ones new_full new_empty_strided
    """,
}

OPS: dict[str, OpDef] = {}
for _cat, _names in _TABLE.items():
    for _n in _names.split():
        OPS[_n] = OpDef(_n, _cat)

# Kiln's own ops.
for _n in ("input", "scalar", "constant", "getitem", "sym_size", "sym_numel", "sym_stride", "pyop"):
    OPS[_n] = OpDef(_n, Category.META)
OPS["opaque"] = OpDef("opaque", Category.OPAQUE)
OPS["fused"] = OpDef("fused", Category.ELEMENTWISE)
OPS["writeback"] = OpDef("writeback", Category.META)

# Ops whose value depends on data and which no pass may duplicate or drop.
SIDE_EFFECTS: frozenset[str] = frozenset({"opaque", "writeback"})


def packet_of(op: str) -> str:
    """``"add.Tensor"`` -> ``"add"``; ``"opaque.aten::nonzero.default"`` -> ``"opaque"``."""
    return op.split(".", 1)[0]


def opaque_target(op: str) -> str:
    """The qualified ATen name an opaque node runs: ``"aten::nonzero.default"``."""
    assert op.startswith("opaque."), op
    return op[len("opaque.") :]


def category(op: str) -> Category:
    d = OPS.get(packet_of(op))
    if d is None:
        raise KeyError(f"unknown Kiln op {op!r}")
    return d.category


def is_known(op: str) -> bool:
    return packet_of(op) in OPS
