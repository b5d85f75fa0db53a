"""Generated kernels for 2-D max pooling: ``max_pool2d_with_indices`` and its backward.

ATen's CPU kernel for a contiguous (NCHW) input evaluates each window in a generic scalar loop;
a CNN's 2x2 pooling after a convolution took more time than the convolution (small bench CNN,
1 thread: 2.2 ms for ``[32,16,32,32]``, the kernel below 0.14 ms).  Here the window's geometry
(kernel size, stride, padding, dilation) is compiled in: outputs whose window lies inside the
input run a straight-line, vectorized loop over a row of outputs; the rest (padding, ``ceil_mode``
overhang) take ATen's clipped loop.  Both follow ATen's rule exactly: the window is scanned row by
row, a value is taken when ``v > max`` or ``v`` is NaN, the index starts at the window's first
element (so an all ``-inf`` window gives its first element, and NaN wins, the last one seen).

The backward zeroes each plane of the input's gradient and adds each output gradient at its
index, in ATen's order (so overlapping windows add up the same way); an index of -1 is skipped as
in ATen, any other index outside the plane raises (ATen would write outside the buffer).

Two fused variants, built by passes of this backend: ``relu_max_pool2d`` (:mod:`kiln.passes.
relu_pool`) writes a plane of the ReLU's output and pools it while it is in cache, and
``max_pool2d_relu_backward`` (:mod:`kiln.passes.pool_relu`) adds a gradient only where the ReLU's
output at its index is not ``<= 0`` (the ReLU's backward of the summed gradient).

Taken at run time when the tensors are float32 and contiguous; any other call (another dtype, a
channels-last or strided input, which ATen's own channels-last kernel handles well) runs ATen's
op, with ATen's result layout.  Calling convention: ``int64_t name(void** P, const int64_t* I)``
(no scalars), called through ctypes by the callable :func:`pool_call` makes (a Python callback
when the native launcher runs the graph: a few microseconds per call).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.codegen.cpp import executor
from kiln.codegen.cpp.emit import PARALLEL_MIN
from kiln.ir.graph import In, Node

FORWARD = "max_pool2d_with_indices.default"
BACKWARD = "max_pool2d_with_indices_backward.default"
# the backward and the ReLU's backward before it, as one node (kiln.passes.pool_relu)
RELU_BACKWARD = "max_pool2d_relu_backward.default"
# a ReLU and the pool after it, as one node (kiln.passes.relu_pool): (relu out, values, indices)
RELU_FORWARD = "relu_max_pool2d.default"
OPS = (FORWARD, BACKWARD, RELU_BACKWARD, RELU_FORWARD)
F32 = torch.float32


@dataclass(frozen=True)
class Window:
    """A 2-D pooling window: (height, width) pairs."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    ceil_mode: bool

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        """ATen's pooling output size (``pooling_output_shape``)."""
        return (self._out(h, 0), self._out(w, 1))

    def _out(self, n: int, d: int) -> int:
        k, s, p, dl = self.kernel[d], self.stride[d], self.padding[d], self.dilation[d]
        num = n + 2 * p - dl * (k - 1) - 1 + (s - 1 if self.ceil_mode else 0)
        o = num // s + 1  # floor division, as ATen's div_rtn
        if self.ceil_mode and (o - 1) * s >= n + p:
            o -= 1
        return o


def _pair(v: Any, default: tuple[int, int] | None) -> tuple[int, int] | None:
    if isinstance(v, (list, tuple)):
        if len(v) == 0 and default is not None:
            return default
        if len(v) == 1:
            v = (v[0], v[0])
        if len(v) != 2:
            return None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return None
        return (int(v[0]), int(v[1]))
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    return None


def _window(args: Sequence[Any]) -> Window | None:
    """The window of ``(kernel_size, stride, padding, dilation, ceil_mode)`` arguments (ATen's
    defaults for those left out), or None where one is not a constant of the expected form."""
    args = list(args) + [None] * (5 - len(args))
    k = _pair(args[0], None)
    if k is None:
        return None
    s = _pair([] if args[1] is None else args[1], k)
    p = _pair(0 if args[2] is None else args[2], None)
    d = _pair(1 if args[3] is None else args[3], None)
    ceil = False if args[4] is None else args[4]
    if s is None or p is None or d is None or not isinstance(ceil, bool):
        return None
    if min(*k, *s, *d) < 1 or min(p) < 0 or p[0] > k[0] // 2 or p[1] > k[1] // 2:
        return None  # ATen rejects these; it runs and raises its own error
    return Window(k, s, p, d, ceil)


_FWD_NAMES = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_BWD_NAMES = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "indices")


def node_window(n: Node) -> Window | None:
    """The window of a max-pool node whose tensors are all node inputs and whose other arguments
    are constants (None otherwise: ATen runs it)."""
    kw = dict(n.kwargs)
    if n.op in (FORWARD, RELU_FORWARD):
        if not n.args or n.args[0] != In(0) or set(kw) - set(_FWD_NAMES):
            return None
        rest = list(n.args[1:]) + [None] * (5 - len(n.args[1:]))
        for i, name in enumerate(_FWD_NAMES):
            if name in kw:
                rest[i] = kw[name]
        return _window(rest)
    if n.op in (BACKWARD, RELU_BACKWARD):
        if kw or len(n.args) != 8 or n.args[:2] != (In(0), In(1)) or n.args[7] != In(2):
            return None
        return _window(n.args[2:7])
    return None


def pool_ok(n: Node, in_types: list) -> bool:
    """Whether ``n`` is a 2-D max pool (or its backward) on float32 3-D/4-D tensors with a
    constant window."""
    if n.op not in OPS or node_window(n) is None:
        return False
    x = in_types[0] if n.op in (FORWARD, RELU_FORWARD) else in_types[1]
    if x is None or x.dtype != F32 or len(x.shape) not in (3, 4):
        return False
    if n.op in (BACKWARD, RELU_BACKWARD):
        g, idx = in_types[0], in_types[2]
        if g is None or idx is None or g.dtype != F32 or idx.dtype != torch.int64:
            return False
    return True


def _helpers(name: str) -> str:
    return f"""#include <algorithm>
KI void {name}_take(float& m, int64_t& bi, const float v, const int64_t q) {{
  const bool take = (v > m) | (v != v);
  m = take ? v : m;
  bi = take ? q : bi;
}}
"""


def _border(name: str, w: Window) -> list[str]:
    """ATen's clipped window loop for output (oh, ow) of plane ``xp``: sets ``m``, ``bi``."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = w.kernel, w.stride, w.padding, w.dilation
    return [
        f"int64_t ih0 = oh * {sh} - {ph}, iw0 = ow * {sw} - {pw};",
        f"const int64_t ih1 = std::min<int64_t>(ih0 + {(kh - 1) * dh + 1}, H);",
        f"const int64_t iw1 = std::min<int64_t>(iw0 + {(kw - 1) * dw + 1}, W);",
        f"while (ih0 < 0) ih0 += {dh};",
        f"while (iw0 < 0) iw0 += {dw};",
        "int64_t bi = ih0 * W + iw0;",
        "float m = -INFINITY;",
        f"for (int64_t ih = ih0; ih < ih1; ih += {dh})",
        f"  for (int64_t iw = iw0; iw < iw1; iw += {dw})",
        f"    {name}_take(m, bi, xp[ih * W + iw], ih * W + iw);",
    ]


def emit_forward(name: str, w: Window, relu: bool = False) -> str:
    """``P``: x, out, indices (``relu``: then the ReLU's output ``r``, which is written plane by
    plane, each pooled right after: ``x`` is the ReLU's input); ``I``: planes, H, W, OH, OW."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = w.kernel, w.stride, w.padding, w.dilation
    # the straight-line window of an inside output at (ih, iw) = (oh*sh - ph, ow*sw - pw)
    body = []
    for a in range(kh):
        for b in range(kw):
            q = f"(ih + {a * dh}) * W + iw + {b * dw}"
            if a == 0 and b == 0:
                body += [f"int64_t bi = {q};", "float m = xp[bi];"]
            else:
                body.append(f"{name}_take(m, bi, xp[{q}], {q});")
    border = "\n".join("        " + s for s in _border(name, w))
    inside = "\n".join("          " + s for s in body)
    # the ReLU as Kiln's relu kernels compute it (kiln_max: NaN kept, -0.0 -> 0)
    relu_plane = (
        "    const float* xc = x + c * H * W;\n"
        "    float* xp = (float*)P[3] + c * H * W;\n"
        "    #pragma omp simd\n"
        "    for (int64_t j = 0; j < H * W; ++j) xp[j] = kiln_max(xc[j], 0.0f);"
    )
    return f"""{_helpers(name)}
extern "C" int64_t {name}(void** P, const int64_t* I) {{
  const float* x = (const float*)P[0];
  float* y = (float*)P[1];
  int64_t* ix = (int64_t*)P[2];
  const int64_t NC = I[0], H = I[1], W = I[2], OH = I[3], OW = I[4];
  if (NC == 0 || OH <= 0 || OW <= 0) return 0;
  // outputs whose window lies inside the input: [oh_lo, oh_hi) x [ow_lo, ow_hi)
  const int64_t oh_lo = {(ph + sh - 1) // sh}, ow_lo = {(pw + sw - 1) // sw};
  const int64_t nh = H - 1 - {(kh - 1) * dh} + {ph}, nw = W - 1 - {(kw - 1) * dw} + {pw};
  const int64_t oh_hi = std::min(OH, nh < 0 ? (int64_t)0 : nh / {sh} + 1);
  const int64_t ow_hi = std::min(OW, nw < 0 ? (int64_t)0 : nw / {sw} + 1);
  #pragma omp parallel for if(NC * OH * OW >= {PARALLEL_MIN})
  for (int64_t c = 0; c < NC; ++c) {{
{relu_plane if relu else "    const float* xp = x + c * H * W;"}
    float* yp = y + c * OH * OW;
    int64_t* ip = ix + c * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh) {{
      float* yr = yp + oh * OW;
      int64_t* ir = ip + oh * OW;
      const bool row_in = oh >= oh_lo && oh < oh_hi;
      const int64_t a = row_in ? std::min(ow_lo, OW) : OW;
      const int64_t b = row_in ? std::max(a, std::min(ow_hi, OW)) : OW;
      for (int64_t ow = 0; ow < a; ++ow) {{
{border}
        yr[ow] = m;
        ir[ow] = bi;
      }}
      if (row_in) {{
        const int64_t ih = oh * {sh} - {ph};
        #pragma omp simd
        for (int64_t ow = a; ow < b; ++ow) {{
          const int64_t iw = ow * {sw} - {pw};
{inside}
          yr[ow] = m;
          ir[ow] = bi;
        }}
      }}
      for (int64_t ow = b; ow < OW; ++ow) {{
{border}
        yr[ow] = m;
        ir[ow] = bi;
      }}
    }}
  }}
  return 0;
}}
"""


def emit_backward(name: str, relu: bool) -> str:
    """``P``: grad out, indices, grad in (``relu``: then the ReLU's output ``x``); ``I``: planes,
    H*W, OH*OW.  Returns the number of indices outside ``[-1, H*W)`` (skipped).  With ``relu``
    a gradient is added only where ``x`` at its index is not ``<= 0`` (``where(x <= 0, 0, .)``
    of the sum: every gradient added at ``q`` meets the same test of ``x[q]``)."""
    add = "if (!(xp[q] <= 0.0f)) gp[q] += go[j];" if relu else "gp[q] += go[j];"
    return f"""
extern "C" int64_t {name}(void** P, const int64_t* I) {{
  const float* g = (const float*)P[0];
  const int64_t* ix = (const int64_t*)P[1];
  float* gi = (float*)P[2];
  {"const float* x = (const float*)P[3];" if relu else ""}
  const int64_t NC = I[0], HW = I[1], OHW = I[2];
  int64_t bad = 0;
  #pragma omp parallel for reduction(+:bad) if(NC * HW >= {PARALLEL_MIN})
  for (int64_t c = 0; c < NC; ++c) {{
    float* gp = gi + c * HW;
    const float* go = g + c * OHW;
    const int64_t* ip = ix + c * OHW;
    {"const float* xp = x + c * HW;" if relu else ""}
    for (int64_t j = 0; j < HW; ++j) gp[j] = 0.0f;
    for (int64_t j = 0; j < OHW; ++j) {{
      const int64_t q = ip[j];
      if (q >= 0 && q < HW) {{
        {add}
      }} else if (q != -1) {{
        ++bad;
      }}
    }}
  }}
  return bad;
}}
"""


def emit_pool(name: str, n: Node) -> str:
    """C++ source of the kernel for a node accepted by :func:`pool_ok`."""
    w = node_window(n)
    assert w is not None
    if n.op in (FORWARD, RELU_FORWARD):
        return emit_forward(name, w, relu=n.op == RELU_FORWARD)
    return emit_backward(name, n.op == RELU_BACKWARD)


def _aten_call(n: Node) -> Callable[[Sequence[Any]], Any]:
    from kiln.codegen.cpp.aten_call import prepared

    return prepared(n)


_P3 = ctypes.c_void_p * 3
_P4 = ctypes.c_void_p * 4
_I5 = ctypes.c_int64 * 5
_I3 = ctypes.c_int64 * 3


def pool_call(n: Node, fn: Any) -> Callable[[Sequence[Any]], list[torch.Tensor]]:
    """The node's callable ``(input values) -> [outputs]``: the kernel ``fn`` where the tensors
    are contiguous float32, ATen's op otherwise."""
    fn.argtypes = None
    fn.restype = ctypes.c_int64
    w = node_window(n)
    assert w is not None
    aten = _aten_call(n)

    def fallback(ins: Sequence[Any]) -> list[torch.Tensor]:
        r = aten(ins)
        return list(r) if isinstance(r, (tuple, list)) else [r]

    if n.op in (FORWARD, RELU_FORWARD):
        relu_out = n.op == RELU_FORWARD

        def forward(ins: Sequence[Any]) -> list[torch.Tensor]:
            x = ins[0]
            if x.dtype != F32 or x.dim() not in (3, 4) or not x.is_contiguous():
                return fallback(ins)
            h, wd = x.shape[-2], x.shape[-1]
            oh, ow = w.out_size(h, wd)
            if oh <= 0 or ow <= 0 or h == 0 or wd == 0:
                return fallback(ins)  # ATen's error for a too-small input
            shape = (*x.shape[:-2], oh, ow)
            y = executor.new_output(shape, F32)
            ix = executor.new_output(shape, torch.int64)
            nc = x.numel() // (h * wd)
            if relu_out:
                r = executor.new_output(tuple(x.shape), F32)
                ptrs = _P4(x.data_ptr(), y.data_ptr(), ix.data_ptr(), r.data_ptr())
                fn(ptrs, _I5(nc, h, wd, oh, ow))
                return [r, y, ix]
            fn(_P3(x.data_ptr(), y.data_ptr(), ix.data_ptr()), _I5(nc, h, wd, oh, ow))
            return [y, ix]

        forward.kiln_kernel = n.op  # type: ignore[attr-defined]  # profiler range name
        return forward

    relu = n.op == RELU_BACKWARD

    def backward(ins: Sequence[Any]) -> list[torch.Tensor]:
        g, x, ix = ins[0], ins[1], ins[2]
        ok = x.dtype == F32 and g.dtype == F32 and ix.dtype == torch.int64
        if not ok or x.dim() not in (3, 4) or not x.is_contiguous():
            return fallback(ins)
        if g.shape != ix.shape or g.dim() != x.dim() or g.shape[:-2] != x.shape[:-2]:
            return fallback(ins)  # ATen's shape error
        g, ix = g.contiguous(), ix.contiguous()
        h, wd = x.shape[-2], x.shape[-1]
        gi = executor.new_output(tuple(x.shape), F32)
        nc = x.numel() // (h * wd) if h * wd else 0
        if gi.numel() == 0:
            return [gi]
        ptrs = [g.data_ptr(), ix.data_ptr(), gi.data_ptr()]
        bad = fn(
            _P4(*ptrs, x.data_ptr()) if relu else _P3(*ptrs),
            _I3(nc, h * wd, g.shape[-2] * g.shape[-1]),
        )
        if bad:
            raise RuntimeError(
                f"kiln: {n.op.split('.')[0]} got {bad} indices outside the input's "
                f"{h}x{wd} plane; indices must come from max_pool2d_with_indices on the same input"
            )
        return [gi]

    backward.kiln_kernel = n.op  # type: ignore[attr-defined]
    return backward
