"""The Kiln op set: one record (:class:`OpDef`) per op, the ground floor every layer reads.

A record says what an op *means*: its category (what passes may assume), its reference
implementation (the ATen callable the interpreter runs, or Kiln's own function), its type rule
(default: the reference implementation run on meta tensors), whether the compile frontend keeps it
whole instead of decomposing it, the in-place ATen ops whose functional variant it is, and, for an
op Kiln deliberately does not lower, the reason it falls back to ATen.  Records are registered with
:func:`defop` next to their definition, in the style of JAX's per-primitive rules; the interpreter,
verifier, passes, frontends and backends all look ops up here, and nothing in ``kiln.ir`` imports a
layer above it.

Kiln ops are named after the core ATen ops they mean (``add.Tensor``, ``mm.default``), so the
reference interpreter can run any of them through ATen, and the code generator can pick the ones it
fuses by category.  A handful of ops are Kiln's own (defined in :mod:`kiln.ir.semantics`):

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
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln import metrics
from kiln.ir import matmul_strided


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
    """Everything Kiln knows about one op (an ATen packet such as ``"add"``; the overload is kept
    on the node)."""

    name: str
    category: Category
    # Reference implementation: ``impl(op)`` gives the callable a node of op ``op`` (the full name,
    # "add.Tensor") runs on its filled arguments; None: ``torch.ops.aten.<packet>.<overload>``.
    impl: Callable[[str], Callable[..., Any]] | None = None
    # Type rule ``(node, input metas) -> output value on the meta device``; None: run the reference
    # implementation on meta tensors.  Ops whose result cannot be derived (opaque) set ``opaque_types``.
    infer: Callable[..., Any] | None = None
    opaque_types: bool = False  # the node's own types are trusted (nothing to re-derive)
    keep_whole: bool = False  # the compile frontend does not decompose it (a backend has a kernel)
    # In-place ATen overloads whose functional form is an overload of this op but not simply the
    # name without its trailing underscore: (("bernoulli_.float", "bernoulli.p"),)
    inplace: tuple[tuple[str, str], ...] = ()
    fallback: str | None = None  # set: Kiln does not lower this op, and this is why
    side_effects: bool = False  # no pass may duplicate, drop or reorder it
    # The operator namespace the record's ATen-level op lives in (``prims`` for ``prims::fma``):
    # lowering maps ``<namespace>::<name>`` calls to this record; ``impl`` must be set for others.
    namespace: str = "aten"


OPS: dict[str, OpDef] = {}  # ops a graph may hold
FALLBACKS: dict[str, OpDef] = {}  # ATen ops Kiln deliberately leaves to ATen, with the reason
ON_CHANGE: list[Callable[[], None]] = []  # called when a record changes (caches built from them)


def defop(name: str, category: Category, **fields: Any) -> OpDef:
    """Register the record for one op (``replace=True`` to redefine one); returns it."""
    replace = fields.pop("replace", False)
    d = OpDef(name, category, **fields)
    table = FALLBACKS if d.fallback is not None else OPS
    if not replace and (name in OPS or name in FALLBACKS):
        raise ValueError(f"Kiln op {name!r} is already defined; pass replace=True to redefine it")
    OPS.pop(name, None)
    FALLBACKS.pop(name, None)
    table[name] = d
    for hook in ON_CHANGE:
        hook()
    return d


def undefop(name: str) -> None:
    """Remove an op's record (for tests that define a temporary op)."""
    OPS.pop(name, None)
    FALLBACKS.pop(name, None)
    for hook in ON_CHANGE:
        hook()


def record(op: str) -> OpDef:
    """The record of a node's op (``"add.Tensor"`` -> the ``add`` record); KeyError if unknown."""
    d = OPS.get(packet_of(op))
    if d is None:
        raise KeyError(f"unknown Kiln op {op!r}")
    return d


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
    _adaptive_avg_pool2d _adaptive_avg_pool2d_backward col2im im2col contiguous t_copy
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

for _cat, _names in _TABLE.items():
    for _n in _names.split():
        defop(_n, _cat)

# Kept whole by the compile frontend: Kiln has one kernel for each (kiln/codegen/cpp: layer norm
# and softmax backward, GELU backward as one fused formula), or ATen's own beats the decomposition
# on CPU (embedding_dense_backward decomposes to an accumulating index_put, 4-5x slower).
# Decomposed, a layer norm backward became five row/column kernels, ~6x the time of the one kernel.
# SDPA's CPU kernel must stay whole: torch's decomposition of it returns the attention
# probabilities (B, H, L, S) where the kernel returns the log-sum-exp (B, H, L), and the backward
# kernel (not decomposed: ATen runs it) reads that second output as the log-sum-exp, so every
# gradient came out wrong.  tests/passes/test_decomp_contract.py checks that every decomposition
# the compile frontend uses reproduces all outputs of its op, not only the first.
for _n in (
    "_scaled_dot_product_flash_attention_for_cpu",
    "embedding_dense_backward",
    "native_layer_norm_backward",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "gelu_backward",
    # one fused multiply-add in ATen's CPU kernels (and in Kiln's formulas); decomposed, the
    # product is rounded before the add and overflow edges differ (NaN or inf vs eager's value)
    "tanh_backward",
    "addcmul",
    "lerp",
    # ATen: grad * (1 - y) * y (in float16 arithmetic for float16); torch's decomposition
    # multiplies grad * (y * (1 - y)): 2,467 of 8,192 float16 elements off
    "sigmoid_backward",
    # ATen: dy * s * (1 + x * (1 - s)) in one kernel (Kiln's kiln_silu_bwd); torch's decomposition
    # multiplies in another order: 1,879 of 8,192 float32 elements off, 24 whole
    "silu_backward",
    # ATen: x / (1 + exp(-x)); torch's decomposition x * sigmoid(x): 1,982 of 8,192 float32
    # elements off, 29 whole
    "silu",
    # ATen sums the picked log-probabilities in float and divides before it rounds; torch's
    # decomposition sums in the input's dtype: a bf16 cross-entropy was one ulp off in 26 of 40
    "nll_loss_forward",
):
    defop(_n, OPS[_n].category, keep_whole=True, replace=True)

# In-place ops whose functional variant is not just the name without the trailing underscore.
defop("bernoulli", _X, inplace=(("bernoulli_.float", "bernoulli.p"),), replace=True)
defop(
    "normal_functional",
    _X,
    inplace=(("normal_.default", "normal_functional.default"),),
    replace=True,
)

# Ops Kiln deliberately does not lower, each with its reason: they become ``opaque`` nodes that
# the executor runs through ATen exactly as eager PyTorch would, counted by name in kiln.metrics.
_DATA_SHAPE = "output shape depends on the data"
_SYNC_NUMBER = "returns a Python number: forces a sync"
_SYNC_BOOL = "returns a Python bool: forces a sync"
_SOLVER = "iterative LAPACK solver: no Kiln kernel"
_FACTOR = "LAPACK factorization: no Kiln kernel"
_FFT = "FFT: no Kiln kernel"
for _n, _why in {
    "nonzero": _DATA_SHAPE,
    "unique": _DATA_SHAPE,
    "_unique2": _DATA_SHAPE,
    "unique_consecutive": _DATA_SHAPE,
    "unique_dim": _DATA_SHAPE,
    "masked_select": _DATA_SHAPE,
    "_local_scalar_dense": _SYNC_NUMBER,
    "item": _SYNC_NUMBER,
    "equal": _SYNC_BOOL,
    "is_nonzero": _SYNC_BOOL,
    "linalg_eigh": _SOLVER,
    "_linalg_eigh": _SOLVER,
    "linalg_svd": _SOLVER,
    "_linalg_svd": _SOLVER,
    "linalg_qr": _FACTOR,
    "_linalg_det": _FACTOR,
    "linalg_lu_factor_ex": _FACTOR,
    "_fft_r2c": _FFT,
    "_fft_c2r": _FFT,
    "_fft_c2c": _FFT,
}.items():
    defop(_n, Category.OPAQUE, fallback=_why)


def packet_of(op: str) -> str:
    """``"add.Tensor"`` -> ``"add"``; ``"opaque.aten::nonzero.default"`` -> ``"opaque"``."""
    return op.split(".", 1)[0]


def opaque_target(op: str) -> str:
    """The qualified ATen name an opaque node runs: ``"aten::nonzero.default"``."""
    assert op.startswith("opaque."), op
    return op[len("opaque.") :]


def category(op: str) -> Category:
    return record(op).category


def is_known(op: str) -> bool:
    return packet_of(op) in OPS


_FRESH = {
    Category.ELEMENTWISE,
    Category.REDUCTION,
    Category.MATMUL,
    Category.FACTORY,
    Category.RANDOM,
}


def fresh_buffer(op: str, cat: Category) -> bool:
    """Whether the op's outputs are new buffers (never views of its inputs)."""
    if op == "fused":
        return True
    if cat is Category.DATA_MOVEMENT:
        return not op.startswith("contiguous")
    return cat in _FRESH and not op.startswith(("alias", "copy."))


def side_effect_ops() -> frozenset[str]:
    """Ops whose value depends on data and which no pass may duplicate or drop."""
    return frozenset(n for n, d in OPS.items() if d.side_effects)


def keep_whole_ops() -> tuple[str, ...]:
    """Packets the compile frontend keeps whole instead of decomposing."""
    return tuple(n for n, d in OPS.items() if d.keep_whole)


def functional_variant(inplace: str) -> str | None:
    """The functional ``"packet.overload"`` registered for an in-place ATen overload, if any."""
    for d in OPS.values():
        for src, dst in d.inplace:
            if src == inplace:
                return dst
    return None


def fallback_reason(packet: str) -> str:
    d = FALLBACKS.get(packet)
    return d.fallback if d is not None and d.fallback else "no Kiln lowering rule for this op yet"


# --- Kiln's own ops, each defined next to its record ---------------------------------------------


def writeback(dst: Any, src: Any) -> Any:
    """``dst.copy_(src)``, skipped when a kernel already wrote ``src`` into ``dst`` itself."""
    if src is not dst:
        dst.copy_(src)
        metrics.incr("input_update_copies")
    else:  # written in place by a kernel: tell autograd, as copy_ would
        torch.autograd.graph.increment_version(dst)
    return dst


PYOPS: dict[str, Callable[..., Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "truediv": operator.truediv,
    "mod": operator.mod,
    "neg": operator.neg,
    "pow": operator.pow,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "sym_max": max,
    "sym_min": min,
    "sym_not": operator.not_,
    "sym_float": float,
    "sym_int": int,
    "trunc": math.trunc,
    "floor": math.floor,
    "ceil": math.ceil,
    "sqrt": math.sqrt,
}


def _aten(qual: str) -> Callable[..., Any]:
    """``"aten::nonzero.default"`` -> ``torch.ops.aten.nonzero.default``."""
    ns, rest = qual.split("::", 1)
    name, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")


def _fma(a: Any, b: Any, c: Any) -> torch.Tensor:
    """``prims::fma`` on its graph arguments: Dynamo's graphs pass a Python number where the
    schema wants a tensor (``fma(t1 * t2, value, self)``), which the op itself refuses; such an
    operand becomes a 0-dim tensor of the tensors' dtype."""
    like = next(x for x in (a, b, c) if isinstance(x, torch.Tensor))
    a, b, c = (
        x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=like.dtype, device=like.device)
        for x in (a, b, c)
    )
    return torch.ops.prims.fma.default(a, b, c)


for _n in ("input", "scalar", "constant", "sym_size", "sym_numel", "sym_stride"):
    defop(_n, Category.META, opaque_types=True)
defop("getitem", Category.META, impl=lambda op: operator.getitem)
defop("pyop", Category.META, impl=lambda op: PYOPS[op[len("pyop.") :]], opaque_types=True)
defop(
    "opaque",
    Category.OPAQUE,
    impl=lambda op: _aten(opaque_target(op)),
    opaque_types=True,
    side_effects=True,
)
# prims::fma (a * b + c, one rounding): Dynamo writes in-place ``addcmul_`` / ``addcdiv_`` with a
# ``value`` (every single-tensor Adam/AdamW step) and ``add_`` with a tensor ``alpha`` through it.
defop("fma", Category.ELEMENTWISE, namespace="prims", impl=lambda op: _fma)
defop("fused", Category.ELEMENTWISE, opaque_types=True)


def _nll_log_softmax_backward(
    y: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, checked: torch.Tensor, value: float
) -> torch.Tensor:
    """Reference for ``nll_log_softmax_backward`` (built by :mod:`kiln.passes.cross_entropy`):
    the gradient of a log-softmax over dim 1 of ``y`` (its output, ``[R, V]``) for an incoming
    gradient that is ``value * scale`` at column ``target[r]`` of row ``r`` and ``0 * scale``
    elsewhere, i.e. ``_log_softmax_backward_data(scatter(zeros_like(y), 1, target, value) * scale,
    y, 1, float32)``, the nll_loss backward's one-hot and the log-softmax backward in one op.
    ``checked`` is ``gather(y, 1, target)``: computed (and so the target indices validated, with
    ATen's error) before the op runs; the value itself is not used."""
    dy = torch.zeros_like(y).scatter_(1, target, value) * scale
    return torch.ops.aten._log_softmax_backward_data.default(dy, y, 1, y.dtype)


# The causal-LM loss backward as one op (kiln/passes/cross_entropy.py; the C++ backend has a kernel)
defop(
    "nll_log_softmax_backward",
    Category.REDUCTION,
    impl=lambda op: _nll_log_softmax_backward,
    namespace="kiln",
)  # built by fusion; its backend runs it


def _max_pool2d_relu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: bool,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Reference for ``max_pool2d_relu_backward`` (built by :mod:`kiln.passes.pool_relu`): the
    gradient of ``max_pool2d(relu(...))`` at the ReLU's input, ``where(x <= 0, 0,
    max_pool2d_with_indices_backward(grad, x, ..., indices))`` with ``x`` the ReLU's output."""
    g = torch.ops.aten.max_pool2d_with_indices_backward.default(
        grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices
    )
    return torch.where(x <= 0, torch.zeros((), dtype=g.dtype), g)


def _relu_max_pool2d(x: torch.Tensor, *window: Any) -> tuple[torch.Tensor, ...]:
    """Reference for ``relu_max_pool2d`` (built by :mod:`kiln.passes.relu_pool`): ``r = relu(x)``
    and ``max_pool2d_with_indices(r, *window)``, as ``(r, values, indices)``."""
    r = torch.relu(x)
    return (r, *torch.ops.aten.max_pool2d_with_indices.default(r, *window))


# A ReLU and the max pool after it as one op (the C++ backend has a kernel)
defop(
    "relu_max_pool2d",
    Category.DATA_MOVEMENT,
    impl=lambda op: _relu_max_pool2d,
    namespace="kiln",
)


# A max pool's backward and the ReLU's before it as one op (the C++ backend has a kernel)
defop(
    "max_pool2d_relu_backward",
    Category.DATA_MOVEMENT,
    impl=lambda op: _max_pool2d_relu_backward,
    namespace="kiln",
)
# oneDNN's inner product, ``x @ w.t() + bias`` (``attr`` "none": no post-op): the C++ backend's
# GEMM for large float32 products (kiln.passes.gemm_library says when and why)
defop(
    "_linear_pointwise",
    Category.MATMUL,
    impl=lambda op: torch.ops.mkldnn._linear_pointwise.default,
    namespace="mkldnn",
)
# A batched product reading its operands through their strides, its result in a chosen layout
# (schema, reference kernel, shape rule and gradients in kiln.ir.matmul_strided)
defop(
    "matmul_strided",
    Category.MATMUL,
    impl=lambda op: matmul_strided.OP,
    namespace="kiln",
)
defop("writeback", Category.META, impl=lambda op: writeback, side_effects=True)


def _dense(args: tuple) -> tuple:
    """The tensor arguments row-major: a random op draws its numbers in its input's memory
    order, and a checkpoint's recomputed input may come in another layout than the forward's (a
    kernel keeping a transposed layout in one graph and not in the other), so both draw over
    the same order and the replay repeats the forward's mask element for element."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def _rng_saved(op: str) -> Callable[..., tuple]:
    """``rng_saved.<aten op>``: AOTAutograd's ``run_and_save_rng_state(op, ...)`` on the CPU
    (torch/_prims/rng_prims.py): the generator's state, then the random op's result, flattened
    into one tuple ``(state, *outputs)``."""
    inner = _aten(op[len("rng_saved.") :])

    def run(*args: Any, **kwargs: Any) -> tuple:
        state = torch.get_rng_state()
        out = inner(*_dense(args), **kwargs)
        return (state, *out) if isinstance(out, (tuple, list)) else (state, out)

    return run


def _rng_replayed(op: str) -> Callable[..., Any]:
    """``rng_replayed.<aten op>``: AOTAutograd's ``run_with_rng_state(state, op, ...)`` on the
    CPU: the random op run again from a saved state (the same draws), the generator's own state
    restored after it."""
    inner = _aten(op[len("rng_replayed.") :])

    def run(state: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        current = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            return inner(*_dense(args), **kwargs)
        finally:
            torch.set_rng_state(current)

    return run


# A random op of an activation checkpoint's region whose draws the backward's recomputation
# replays (AOTAutograd's two wrappers; kiln/frontends/compile/rng_replay.py lowers them):
# draws in the forward's order, never merged, dropped or moved.
defop("rng_saved", _X, impl=_rng_saved, opaque_types=True, side_effects=True, namespace="kiln")
defop(
    "rng_replayed", _X, impl=_rng_replayed, opaque_types=True, side_effects=True, namespace="kiln"
)

# Ops whose value depends on data and which no pass may duplicate or drop.
SIDE_EFFECTS: frozenset[str] = side_effect_ops()
