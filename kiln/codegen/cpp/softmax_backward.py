"""Generated row kernels for ``_softmax_backward_data`` and ``_log_softmax_backward_data``.

Taken as they stand in the graph (the lazy device records them; compile mode decomposes them
into pointwise + row-sum nodes the fuser already takes), when they reduce the last dim of
contiguous-shaped float32 tensors.  Per row, with ``dy`` the incoming gradient and ``y`` the
forward output::

    softmax:      dx = y * (dy - sum(dy * y))
    log_softmax:  dx = dy - exp(y) * sum(dy)      (one fused multiply-add, as ATen's build)

The row sums are added in the order of ATen's kernels for these ops
(:func:`kiln.codegen.cpp.sum_order.softmax_row_sum`): the results are eager's bit for bit.
Same calling convention as every generated kernel
(:mod:`kiln.codegen.cpp.emit`).
"""

from __future__ import annotations

import torch

from kiln.codegen.cpp.emit import PARALLEL_MIN, WIDE_VECTORS, KernelSpec
from kiln.codegen.cpp.sum_order import softmax_row_sum
from kiln.ir.graph import In, Node
from kiln.ir.kernel import OutKind

OPS = ("_softmax_backward_data.default", "_log_softmax_backward_data.default")


def softmax_backward_ok(n: Node, in_types: list) -> bool:
    """Whether ``n`` is a last-dim (log_)softmax backward on float32 tensors of one shape."""
    if n.op not in OPS or len(n.args) != 4 or len(in_types) != 2:
        return False
    if not (isinstance(n.args[0], In) and isinstance(n.args[1], In)):
        return False
    if n.args[3] != torch.float32 or any(t is None or t.dtype != torch.float32 for t in in_types):
        return False
    shape = in_types[n.args[0].k].shape
    if tuple(in_types[n.args[1].k].shape) != tuple(shape) or len(shape) == 0:
        return False
    # symbolic sizes (a shape-generic graph) are fine: the kernel reads every size at run time
    # from its inputs, which the types say are of one shape
    return n.args[2] in (-1, len(shape) - 1)


def emit_softmax_backward(name: str, n: Node, in_types: list) -> tuple[str, KernelSpec]:
    """C++ source and call spec for one node accepted by :func:`softmax_backward_ok`."""
    order = [n.args[0].k, n.args[1].k]
    shape = tuple(in_types[order[0]].shape)
    spec = KernelSpec(
        name,
        "softmax_backward",
        len(shape),
        shape,
        order,
        ["full", "full"],
        [],
        [OutKind.FULL],
        out_dtypes=[torch.float32],
        members=(n.op,),
    )
    log = n.op.startswith("_log")
    # the log-softmax backward is bound by its exp: full-width vectors (C++ timing loop,
    # 256x1000, 1 thread: ~190 -> 145 us); the softmax backward stays memory-bound
    wide = WIDE_VECTORS if log else ""
    L = [
        f'extern "C" {wide}void {name}(void** P, const int64_t* I, const double* D) {{',
        "  const float* dy = (const float*)P[0];",
        "  const float* y = (const float*)P[1];",
        "  float* dx = (float*)P[2];",
        "  const int64_t N = " + " * ".join(f"I[{d}]" for d in range(len(shape))) + ";",
        f"  const int64_t L = I[{len(shape) - 1}];",
        "  if (N == 0) return;",
        "  const int64_t rows = N / L;",
        f"  #pragma omp parallel for if(N >= {PARALLEL_MIN})",
        "  for (int64_t r = 0; r < rows; ++r) {",
        "    const float* a = dy + r * L;",
        "    const float* b = y + r * L;",
        "    float* o = dx + r * L;",
        *softmax_row_sum("a[{j}]" if log else "(a[{j}] * b[{j}])", "    "),
        "    const float sf = s;",
        "    #pragma omp simd",
        "    for (int64_t j = 0; j < L; ++j) "
        + ("o[j] = km::fma(-km::exp(b[j]), sf, a[j]);" if log else "o[j] = b[j] * (a[j] - sf);"),
        "  }",
        "}",
    ]
    src = "\n".join(L) + "\n"
    spec.source = src
    return src, spec
