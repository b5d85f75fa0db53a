"""What happens around each GEMM of a compiled graph, for ``kiln explain``.

For every matrix multiply (and fused attention call) of the optimized graph: the library that runs
it, how each operand reaches it (a transposed/permuted view read through its strides, or a
materialized copy), what is fused into the call itself (the bias of ``addmm``/``baddbmm`` or of
oneDNN's inner product), and what runs after it as a separate pass with the reason.  The reasons
are the measured decisions of this code base:

* library: large float32 ``mm``/``addmm`` with a row-major left operand run as oneDNN's inner
  product (``mkldnn::_linear_pointwise``), 5-20% faster than MKL's ``sgemm`` there; so do large
  weight gradients (a transposed left operand), after Kiln's transpose kernel copies it row-major;
  the rest (small products, other dtypes, ``bmm``) on ATen's GEMM (:mod:`kiln.passes.gemm_library`
  has the measurements).

* bias: AOTAutograd's ``linear`` decomposition already gives ``addmm(bias, x, w.t())``: ATen adds
  the bias inside the GEMM (oneDNN/BLAS beta=1), and reads ``w.t()`` by stride, no copy.
* activation after a GEMM (GELU, ...): oneDNN's post-op (``torch.ops.mkldnn._linear_pointwise``,
  "gelu") measured 1.1-1.6x faster than ``addmm`` + GELU for the forward alone (1 thread, wall,
  512x128x512 .. 128x512x1024), but in training the GEMM's output (the activation's input) is
  saved for the backward, so the fused call would still have to write it: kept as addmm + one
  pointwise kernel.
* attention: hand-written softmax attention is rewritten to ATen's flash kernels before
  AOTAutograd (:mod:`kiln.frontends.compile.attention`); they read q/k/v by stride.  Over short
  keys, the chain's products (and any rank-4 product) are ``kiln::matmul_strided``
  (:mod:`kiln.ir.matmul_strided`), which reads the heads by stride too.
"""

from __future__ import annotations

from kiln.ir.graph import Graph, Node

GEMMS = frozenset(
    {
        "mm.default",
        "addmm.default",
        "bmm.default",
        "baddbmm.default",
        "_linear_pointwise.default",
        "matmul_strided.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention_for_cpu_backward.default",
    }
)
_VIEWS = ("permute.default", "t.default", "transpose.int", "expand.default")
_COPIES = ("clone.default", "contiguous.default", "reshape.default", "_to_copy.default")


def _operand(g: Graph, v: int) -> str:
    op = g.nodes[v].op
    if op in _VIEWS:
        return f"%{v} {op.split('.')[0]} view, read by stride"
    if op in _COPIES:
        return f"%{v} {op.split('.')[0]} (a copy made for this operand or another reader)"
    return f"%{v}"


def _after(g: Graph, i: int, outputs: frozenset[int]) -> str:
    """What consumes GEMM ``i``'s result (through views), and why it is a separate pass."""
    seen, stack, consumers, saved = {i}, [i], [], False
    while stack:
        j = stack.pop()
        saved |= j in outputs
        for u in g.users[j]:
            op = g.nodes[u].op
            if op in ("view.default", "reshape.default", "getitem") and u not in seen:
                seen.add(u)
                stack.append(u)
            else:
                consumers.append(f"%{u} {op}")
    if not consumers:
        return "nothing after it" + (" (a graph output)" if saved else "")
    text = ", ".join(sorted(set(consumers))[:3])
    if saved:
        return f"{text}: separate, the GEMM's result is also a graph output (saved for backward)"
    return f"{text}: separate pass (no GEMM post-op fusion in this backend)"


def _library(g: Graph, n: Node) -> str:
    op = n.op
    if op == "_linear_pointwise.default":
        if g.nodes[n.inputs[0]].op == "t_copy.default":
            return (
                "oneDNN inner product (gemm_library: large float32, left operand copied transposed)"
            )
        return "oneDNN inner product (gemm_library: large float32, row-major left operand)"
    if op.startswith("_scaled_dot_product"):
        return "ATen flash attention"
    if op == "matmul_strided.default":
        return "MKL grouped batch GEMM (kiln::matmul_strided: operands read by stride, no copies)"
    return "ATen (MKL sgemm for float32)"


def gemm_epilogues(g: Graph) -> list[dict]:
    """One record per GEMM node of ``g`` (see the module docstring)."""
    outputs = frozenset(g.outputs)
    out = []
    for i, n in enumerate(g.nodes):
        if n.op not in GEMMS:
            continue
        tensor_ins = [v for v in n.inputs if g.nodes[v].types and g.nodes[v].types[0].shape]
        fused = "bias (ATen addmm/baddbmm)" if n.op in ("addmm.default", "baddbmm.default") else "-"
        if n.op == "_linear_pointwise.default":
            fused = "bias (oneDNN)" if len(n.inputs) == 3 else "-"
        out.append(
            {
                "node": i,
                "op": n.op,
                "library": _library(g, n),
                "operands": [_operand(g, v) for v in tensor_ins],
                "fused": fused,
                "after": _after(g, i, outputs),
            }
        )
    return out
