"""Generated row kernel for ``nll_log_softmax_backward`` (:mod:`kiln.passes.cross_entropy`).

The node's inputs: ``y`` (``[R, V]`` float32, the saved log-softmax), ``t`` (``[R, 1]`` int64,
each row's target, already validated by the ``gather`` the pass puts before it), ``w`` (float32,
one value per row, ``[R, 1]``, or one value in all, ``[]``/``[1]``/``[1, 1]``), and the scattered
constant ``c`` (``-1.0`` for nll_loss).  The incoming gradient of the log-softmax is ``a = c * w``
at column ``t`` and ``z = 0 * w`` elsewhere (``z`` is a signed zero, or NaN where ``w`` is not
finite, as in the one-hot product it replaces); its row sum is ``a + (V - 1) * z``, in double
as Kiln's log-softmax backward kernel sums, rounded to float: ``s``.  Per row, one pass::

    dx[j] = z - exp(y[j]) * s          then   dx[t] = a - exp(y[t]) * s

each as one fused multiply-add.  ATen's ``_log_softmax_backward_data`` on the one-hot product
computes ``dy - exp(y) * sum(dy)`` in one fused multiply-add (its build contracts it) with the same
``exp`` (``km::exp``): the same values bit for bit.  A target outside
``[0, V)`` is never written through (the gather raised before; the kernel also checks).
Same calling convention as every generated kernel (:mod:`kiln.codegen.cpp.emit`).
"""

from __future__ import annotations

import torch

from kiln.codegen.cpp.emit import PARALLEL_MIN, WIDE_VECTORS, KernelSpec, _mode
from kiln.ir.graph import In, Node
from kiln.ir.kernel import OutKind

OP = "nll_log_softmax_backward.default"
F32 = torch.float32


def nll_log_softmax_backward_ok(n: Node, in_types: list) -> bool:
    """Whether ``n`` is a node of the form :mod:`kiln.passes.cross_entropy` builds."""
    if n.op != OP or len(n.args) != 5 or len(in_types) != 4:
        return False
    if n.args[:4] != (In(0), In(1), In(2), In(3)) or not isinstance(n.args[4], float):
        return False
    y, t, w = in_types[0], in_types[1], in_types[2]
    if any(x is None for x in (y, t, w)) or y.dtype != F32 or w.dtype != F32:
        return False
    if t.dtype != torch.int64 or len(y.shape) != 2:
        return False
    rows = y.shape[0]
    return tuple(t.shape) == (rows, 1) and tuple(w.shape) in ((), (1,), (1, 1), (rows, 1))


def emit_nll_log_softmax_backward(name: str, n: Node, in_types: list) -> tuple[str, KernelSpec]:
    """C++ source and call spec for one node accepted by :func:`nll_log_softmax_backward_ok`."""
    shape = tuple(in_types[0].shape)
    order = [0, 1, 2]  # the gather's value (input 3) only orders the check before the kernel
    modes = [_mode(in_types[k].shape, shape) for k in order]
    spec = KernelSpec(
        name,
        "nll_log_softmax_backward",
        2,
        shape,
        order,
        modes,
        [],
        [OutKind.FULL],
        out_dtypes=[F32],
        members=(n.op,),
    )
    L = [
        # bound by its exp: full-width vectors (C++ timing loop, 256x1000, 1 thread: 161 -> 108 us)
        f'extern "C" {WIDE_VECTORS}void {name}(void** P, const int64_t* I, const double* D) {{',
        "  const float* y = (const float*)P[0];",
        "  const int64_t* t = (const int64_t*)P[1];",
        "  const float* w = (const float*)P[2];",
        "  float* dx = (float*)P[3];",
        "  const int64_t R = I[0], V = I[1];",
        "  if (R == 0 || V == 0) return;",
    ]
    slot, index = 2, []
    for p, m in enumerate(modes):
        if m == "full":  # [R, 1] read as [R, V] with V == 1: one value per row, contiguous
            index.append("[r]")
        elif m == "one":
            index.append("[0]")
        else:  # "bcast": one value per row, at the row's stride
            L.append(f"  const int64_t st{p} = I[{slot}];")
            index.append(f"[r * st{p}]")
            slot += 2
    c = repr(float(n.args[4]))
    if c in ("inf", "-inf", "nan"):
        c = {"inf": "INFINITY", "-inf": "-INFINITY", "nan": "NAN"}[c]
    L += [
        f"  const float c = {c};",
        f"  #pragma omp parallel for if(R * V >= {PARALLEL_MIN})",
        "  for (int64_t r = 0; r < R; ++r) {",
        f"    const int64_t tr = t{index[1]};",
        f"    const float wr = w{index[2]};",
        "    const float a = c * wr, z = 0.0f * wr;",
        "    const float s = (float)(V > 1 ? (double)a + (double)z * (double)(V - 1) : (double)a);",
        "    const float* yr = y + r * V;",
        "    float* o = dx + r * V;",
        "    #pragma omp simd",
        "    for (int64_t j = 0; j < V; ++j) o[j] = km::fma(-km::exp(yr[j]), s, z);",
        "    if (tr >= 0 && tr < V) o[tr] = km::fma(-km::exp(yr[tr]), s, a);",
        "  }",
        "}",
    ]
    src = "\n".join(L) + "\n"
    spec.source = src
    return src, spec
