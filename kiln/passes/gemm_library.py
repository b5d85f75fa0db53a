"""Which library runs each float32 matrix multiply: oneDNN's inner product where it measured faster.

ATen runs ``mm``/``addmm`` on the CPU with MKL's ``sgemm``.  oneDNN (shipped inside PyTorch, the
library eager already uses for convolutions) has the same product as an inner-product primitive,
``torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")`` = ``x @ w.t() + bias``, and on
this code base's machines it is faster for every GEMM large enough that its ~10 us of per-call setup
(primitive cache lookup, tensor descriptors) does not show, *when the left operand is row-major*.
Measured (torch 2.13, AVX-512, 2 threads, best of 3 medians, GFLOP/s MKL -> oneDNN):

    M x K x N        left row-major        left transposed (a weight gradient's ``dY^T``)
    512x2048x2048    186 -> 212 (NN)       178 -> 191 (TN), 176 -> 200 (TT)
    256x1024x1024    172 -> 218            157 -> 184, 157 -> 161
    1024x1024x256    202 -> 227            184 -> 126, 183 -> 124
    1024x256x96      183 -> 209            143 ->  69, 143 ->  68
    128x1024x1024    1546 -> 1248 us       -
    512x128x384      261 -> 242 us         -
    512x128x128      95 -> 105 us (slower: the setup; 1 thread: 168 -> 164)
    256x128x128      46 -> 54 us (slower)

A short reduction into a wide output is the other case MKL handles slowly (its time there goes with
the output, not the products): ``K <= 32``, ``N >= 512`` and ``M * N >= 2^16`` (a classifier's
input gradient ``dY @ W`` with 10 classes): 512x10x2048 324 -> 138 us, 256x10x1024 153 -> 51,
512x2x2048 492 -> 103, 128x10x768 41 -> 29, 32x10x16384 172 -> 94, 128x10x512 29 -> 25, while
1024x10x256 (a narrow output) 41 -> 47, 16x10x1024 9 -> 20 and 8x10x4096 14 -> 24 are slower.

The crossover at 2 threads is ~2^24 multiply-adds (512x64x512: 1.08x, 256x256x256: 1.00x,
512x128x128: 0.90x); at 1 thread it is lower (~6M: 512x128x96 1.01x).  So the rule: a float32
``mm(a, b)`` or ``addmm(bias, a, b)`` (``beta = alpha = 1``, a 1-D bias of the output's width) with
static ``K`` and ``N``, ``K > 0`` (oneDNN cannot create a primitive for an empty reduction),
``M * K * N >= 2^24`` (a symbolic ``M`` counts as unknown: only ``K * N >= 2^18``, i.e. ``M >= 64``
would do) or the short-reduction case above, and a left operand known to have rows of stride 1
(made by a Kiln kernel, a GEMM, ``cat`` or a contiguous copy, then only reshaped, sliced with unit
steps or permuted with the last dim kept last; a graph input's layout is not known: AOTAutograd
passes saved activations such as HF GPT-2's ``x^T`` as transposed views, and oneDNN took
0.91-1.49x MKL's time with a transposed left operand) becomes

    _linear_pointwise.default(a, w, bias, "none", [], "")      with w = b.t()

(``w`` is ``b``'s own source when ``b`` is already ``t(w)``: a linear layer's ``addmm(bias, x,
t(w))``).

A transposed left operand ``a = t(d)`` (a weight gradient ``dY^T @ X``, the reduction over the
rows of both) is slow on oneDNN as it stands (above: oneDNN reorders it) and ATen's transposing
copy (``d.t().contiguous()``, ~6.5 GB/s) eats the gain, but Kiln's own transpose kernel
(:mod:`kiln.codegen.cpp.transpose`, 3-7x ATen's copy) does not.  Measured, 2 threads, best of 4
medians, each call after a pointwise kernel that writes ``dY`` (as in a backward pass), MKL's
``mm(dY.t(), X)`` -> ``t_copy`` + oneDNN, O x M x I = ``dW``'s rows, the reduction, its columns:

    2048x512x2048   23.2 -> 20.4 ms (0.88)      1024x1024x256   2.97 -> 2.60 ms (0.88)
    2048x512x1024   11.1 -> 10.2 ms (0.92)      768x1024x256    2.05 -> 1.92 ms (0.94)
    256x1024x1024   2.83 -> 2.51 ms (0.89)      256x1024x256     715 -> 659 us  (0.92)
    512x512x128      426 -> 356 us  (0.84)      384x512x128      292 -> 276 us  (0.95)
    128x512x512      388 -> 353 us  (0.91)      512x256x128      220 -> 197 us  (0.90)
    256x512x128      207 -> 203 us  (0.99)      256x256x256      192 -> 194 us  (1.01)
    128x512x128      110 -> 121 us  (1.10, slower)

Break-even is near 2^24 multiply-adds; the rule takes 2^25 and up.  (MKL's own NN product of the
copy, the copy included, took 0.88-1.03x its TN product's time, less than oneDNN gains.)  Larger
copies, no longer in cache when the product reads them, gain little or lose: 8192x512x256 (a
16 MiB copy) 12.3 -> 11.7 ms (0.95), 4096x1024x512 (16 MiB) 0.99, 50257x256x768 (a GPT-2 LM
head, 49 MiB) 0.99, 30522x256x128 (BERT's masked-LM decoder, 30 MiB) 14.2 -> 15.2 ms (1.07).
So ``mm(t(d), b)`` with static sizes, ``O * M * I >= 2^25`` and a copy of at most 4 MiB becomes
``_linear_pointwise(t_copy(d), b.t(), ...)`` where the copy (alive until the product is done)
fits under the graph's own peak memory (:func:`kiln.passes.live_bytes.headroom`: at the
start of a backward pass, where the saved activations are all alive, it usually does not, and the
GEMM stays on MKL; without this check gpt-large's steady-step peak of tensor memory rose from
eager's 115.3 MB to 116.5).  A graph with symbolic sizes gets no copies (its peak is unknown).
``KILN_DISABLE_PASSES=gemm_transposed`` leaves this case alone (the rest of the pass still runs).

oneDNN reads ``a`` and ``w`` by stride (rows, columns and zero strides checked against ATen), but
not the bias: an expanded bias (stride 0) gave wrong sums, so a bias that is not a
fresh buffer of the graph is read through ``contiguous`` (the tensor itself when it already is).

Numerics: oneDNN's sums are not MKL's (the bits differ from eager's GEMMs, by a few ulp of the
largest product: max relative error against float64 1.2e-6 at K = 2048, MKL's 3.4e-7; both well
inside fp32 training noise); the choice depends only on the graph (never on timing), so a graph
gives the same bits on every run.  Float64, half types, ``bmm`` and zero-``K`` products stay ATen's.

Needs: a typed graph (this pass is one of the C++ backend's own, after ``fuse``).  Guarantees: same
values up to the summation order of the rewritten GEMMs; shapes and dtypes unchanged; nothing is
rewritten where ``torch.ops.mkldnn`` is missing; transposes left unread are removed (``dce``).
``KILN_DISABLE_PASSES=gemm_library`` turns it off (every GEMM on ATen's MKL path, bit for bit eager's).  Each compiled graph's rewritten GEMMs
are counted in ``kiln.metrics`` as ``gemm_onednn``, the transposing copies made for them as
``gemm_transposing_copies``.
"""

from __future__ import annotations

import torch

from kiln import metrics
from kiln.config import config
from kiln.ir.graph import Graph, In, Node, TensorType
from kiln.ir.ops import category, fresh_buffer
from kiln.passes._util import Rewriter
from kiln.passes.dce import dce
from kiln.passes.live_bytes import headroom
from kiln.passes.rewrite import Rule, apply_rules
from kiln.passes.simplify import PERM_OPS, RESHAPES, perm

OP = "_linear_pointwise.default"
MIN_MACS = 1 << 24  # multiply-adds below which MKL's lower call overhead wins (2 threads)
MIN_KN_SYMBOLIC_M = 1 << 18  # K * N for a symbolic M (MIN_MACS at M = 64)
# A short reduction writing a wide output (a 10-class classifier's input gradient): MKL is slow
# there, oneDNN up to 3-5x faster, from this output size and width on
MAX_SHORT_K, MIN_SHORT_K_OUT, MIN_SHORT_K_N = 32, 1 << 16, 512
# A transposed left operand, copied row-major by Kiln's transpose kernel first (the docstring)
MIN_MACS_TRANSPOSED = 1 << 25
# ... and at most this big a copy (4 MiB: in cache when the product reads it; 16-49 MiB copies
# measured 0.95-1.07x MKL's time, the docstring)
MAX_COPY_BYTES = 1 << 22
TRANSPOSE = "t_copy.default"


def available() -> bool:
    return torch._C._has_mkldnn and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _static(d: object) -> bool:
    return isinstance(d, int) and not isinstance(d, bool)


def _big_enough(m: object, k: object, n: object) -> bool:
    if not (_static(k) and _static(n)) or k <= 0:  # type: ignore[operator]
        return False
    if not _static(m):
        return k * n >= MIN_KN_SYMBOLIC_M  # type: ignore[operator]
    if m * k * n >= MIN_MACS:  # type: ignore[operator]
        return True
    return k <= MAX_SHORT_K and n >= MIN_SHORT_K_N and m * n >= MIN_SHORT_K_OUT  # type: ignore[operator]


def _big_enough_transposed(m: object, k: object, n: object) -> bool:
    """Whether an ``m x n`` product over ``k`` pays for copying its transposed left operand."""
    if not (_static(m) and _static(k) and _static(n)):
        return False
    return k > 0 and m * k * n >= MIN_MACS_TRANSPOSED  # type: ignore[operator]


def _transposed(rw: Rewriter, v: int) -> int | None:
    """If value ``v`` is a transpose of a 2-D ``w`` (``t``, ``transpose``, ``permute``): ``w``."""
    n = rw.node(v)
    if n.op not in PERM_OPS or not n.args or n.args[0] != In(0) or len(n.inputs) != 1:
        return None
    t = rw.type(n.inputs[0])
    if t is None or len(t.shape) != 2:
        return None
    return n.inputs[0] if perm(rw, n) == (1, 0) else None


# Ops whose result always has unit last stride (all but one are contiguous): Kiln's kernels (fused, layer norm, softmax backward, the
# loss backward, the transposing copy) and ATen's GEMMs, concatenation and contiguous copies
_CONTIGUOUS_MAKERS = frozenset(
    {
        "fused",
        "t_copy.default",
        "mm.default",
        "addmm.default",
        "bmm.default",
        "baddbmm.default",
        OP,
        "cat.default",
        "embedding.default",
        "native_layer_norm.default",
        "native_layer_norm_backward.default",
        "_softmax_backward_data.default",
        "_log_softmax_backward_data.default",
        "nll_log_softmax_backward.default",
        "contiguous.default",
        # dense in its ``order``, which always keeps the last dim innermost
        "matmul_strided.default",
    }
)
# Views after which the last dim still has stride 1 if it had before (a reshape that cannot view
# copies, contiguous; one that can keeps the trailing stride)
_KEEP_LAST_DIM = frozenset({*RESHAPES, "alias.default", "detach.default"})


def _unit_last_stride(rw: Rewriter, v: int) -> bool:
    """Whether value ``v`` is known to have a last dim of stride 1 (row-major rows, any row
    stride: what oneDNN reads fast) whatever the graph inputs' layouts: made contiguous, then
    only viewed in ways that keep that.  A graph input is not known: a saved activation can arrive
    transposed (HF GPT-2's ``Conv1D`` weight gradients got ``x^T`` with strides (1, rows), which
    oneDNN read several times slower than MKL)."""
    for _ in range(32):
        n = rw.node(v)
        if n.op in _CONTIGUOUS_MAKERS:
            return True
        if n.op == "clone.default":
            fmt = n.kwarg("memory_format")
            if fmt is torch.contiguous_format:
                return True
            if fmt not in (None, torch.preserve_format):
                return False
        elif n.op == "getitem":
            return rw.node(n.inputs[0]).op in _CONTIGUOUS_MAKERS
        elif n.op == "slice.Tensor":  # (self, dim, start, end, step): a unit step keeps strides
            if (n.args[4] if len(n.args) > 4 else n.kwarg("step", 1)) != 1:
                return False
        elif n.op in PERM_OPS:
            p = perm(rw, n)
            if p[-1] != len(p) - 1:
                return False  # the last dim moved
        elif n.op not in _KEEP_LAST_DIM:
            return False
        if not n.args or n.args[0] != In(0):
            return False
        v = n.inputs[0]
    return False


def _weight(rw: Rewriter, b: int, bt: TensorType) -> int:
    """``b.t()`` as a value: ``b``'s source if ``b`` is a transpose, else a new ``t`` node."""
    w = _transposed(rw, b)
    if w is not None:
        return w
    k, n = bt.shape
    return rw.add(Node("t.default", (b,), (In(0),), (), (TensorType((n, k), bt.dtype),)))


def _fresh(rw: Rewriter, v: int) -> bool:
    """Whether value ``v`` is a new buffer made by the graph (a kernel's or an op's output; 1-D,
    so contiguous), not an input, a constant or a view."""
    op = rw.node(v).op
    try:
        return fresh_buffer(op, category(op))
    except KeyError:
        return False


def _rewritable(
    rw: Rewriter, n: Node, a: int, b: int, room: list[int] | None
) -> tuple[int, TensorType] | None:
    """(left operand, ``b``'s type) if GEMM ``n`` of ``a`` and ``b`` goes to oneDNN (the module
    docstring's rule); a transposed ``a`` is replaced by its row-major copy (a new node) where
    the copy fits under the graph's peak memory (``room``: per node of the graph being rewritten,
    :func:`kiln.passes.live_bytes.headroom`)."""
    out, at, bt = n.type, rw.type(a), rw.type(b)
    if out is None or at is None or bt is None:
        return None
    if not all(t.dtype == torch.float32 for t in (out, at, bt)):
        return None
    if len(at.shape) != 2 or len(bt.shape) != 2:
        return None
    (m, k), (_, cols) = at.shape, bt.shape
    d = _transposed(rw, a)
    if d is None:
        return (a, bt) if _unit_last_stride(rw, a) and _big_enough(m, k, cols) else None
    # not a pass of its own: "gemm_transposed" in KILN_DISABLE_PASSES leaves these on MKL (A/B)
    if "gemm_transposed" in config.disabled_passes or not _big_enough_transposed(m, k, cols):
        return None
    copy_bytes = m * k * at.dtype.itemsize  # type: ignore[operator]
    if copy_bytes > MAX_COPY_BYTES:
        return None
    if room is None or room[rw.current] < copy_bytes:
        return None  # the copy would raise the graph's peak memory (or sizes are symbolic)
    copy = rw.add(Node(TRANSPOSE, (d,), (In(0),), (), (TensorType((m, k), at.dtype),)))
    return copy, bt


def mm_to_onednn(rw: Rewriter, n: Node, room: list[int] | None = None) -> Node | None:
    """``mm(a, b)`` -> ``_linear_pointwise(a, b.t(), None, ...)`` (see the module docstring)."""
    if n.kwargs or n.args != (In(0), In(1)):
        return None
    a, b = n.inputs
    ok = _rewritable(rw, n, a, b, room)
    if ok is None:
        return None
    a, bt = ok
    w = _weight(rw, b, bt)
    return Node(OP, (a, w), (In(0), In(1), None, "none", [], ""), (), n.types)


def addmm_to_onednn(rw: Rewriter, n: Node, room: list[int] | None = None) -> Node | None:
    """``addmm(bias, a, b)`` with a 1-D bias and ``beta = alpha = 1`` -> ``_linear_pointwise(a,
    b.t(), bias, ...)``."""
    if n.args[:3] != (In(0), In(1), In(2)) or len(n.args) > 3:
        return None
    if any(k not in ("beta", "alpha") or v != 1 for k, v in n.kwargs):
        return None
    bias, a, b = n.inputs
    bias_t = rw.type(bias)
    if bias_t is None or bias_t.dtype != torch.float32:
        return None
    if tuple(bias_t.shape) != (n.type.shape[1],):  # type: ignore[union-attr]
        return None
    ok = _rewritable(rw, n, a, b, room)
    if ok is None:
        return None
    a, bt = ok
    if not _fresh(rw, bias):
        bias = rw.add(Node("contiguous.default", (bias,), (In(0),), (), (bias_t,)))
    w = _weight(rw, b, bt)
    return Node(OP, (a, w, bias), (In(0), In(1), In(2), "none", [], ""), (), n.types)


def rules(room: list[int] | None) -> tuple[Rule, ...]:
    """The pass's rules for one graph (``room``: its per-node memory headroom, or None)."""
    return (
        # mm(a, b) -> oneDNN inner product of a and b.t() (large; a transposed a copied row-major)
        Rule("mm_to_onednn", ("mm.default",), lambda rw, n: mm_to_onednn(rw, n, room)),
        # addmm(bias, a, b) -> the same with the bias added by oneDNN
        Rule("addmm_to_onednn", ("addmm.default",), lambda rw, n: addmm_to_onednn(rw, n, room)),
    )


def gemm_library(g: Graph) -> Graph:
    """Apply :func:`rules` once (a rewritten node is never a candidate again); the transposes
    the rewritten GEMMs read no more are dropped."""
    if not available() or not any(n.op in ("mm.default", "addmm.default") for n in g.nodes):
        return g
    out = apply_rules(g, rules(headroom(g)), max_iters=1)
    if out is g:
        return g
    metrics.incr("gemm_onednn", sum(n.op == OP for n in out.nodes))
    metrics.incr("gemm_transposing_copies", sum(n.op == TRANSPOSE for n in out.nodes))
    return dce(out)
