"""Generated row kernels for ``native_layer_norm`` and ``native_layer_norm_backward``.

Both ATen ops are taken as they stand in the graph (no fusion pass involved): a node normalizing
the last dim of a float32 tensor (any rank, one-element rows included), with or without weight
and bias, becomes one kernel.

Forward, per row: mean and variance in double (two passes over the row, like a stable
``var(unbiased=False)``), ``rstd = 1 / sqrt(var + eps)``, ``out = ((x - m) - mc) * rstd * w + b``
in float, ``m`` the mean rounded to float and ``mc = mean - m`` what the rounding left out; outputs
``(out, mean, rstd)`` with ATen's shapes (``mean``/``rstd`` keep the normalized dim as 1).
``x - m`` is exact where ``x`` is near the mean, so ``x - mean`` is rounded once there.  With
``x - m`` alone the mean's rounding shifted the whole row, which ``rstd`` amplifies: on rows
spread 1e-2 around a mean of 1 the output error was 100x this one's and above eager's (ATen
computes ``x * rstd - mean * rstd`` in float; ``tests/kernels/test_layer_norm_accuracy.py``).  A
row of equal values (one element, or a broadcast value) has an exact double mean, ``mc`` is 0,
``x - m`` exactly 0 and ``out`` exactly ``b``.

Backward (any output mask: all three are computed, the unrequested ones are not read), per row
with ``xhat = (x - mean) * rstd`` and ``g = dy * w`` (``dy`` without weight)::

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat          db = sum over rows of dy

Two passes per row, in float except where noted.  The first sums ``d = x - mu`` (``mu`` the
saved mean: near the row's values, so ``d`` is exact or nearly, and no sum cancels digits the
way ``sum(g * x) - mean * sum(g)`` would), ``g * d``, and ``g`` in double (a row of equal ``g``
then has ``mean(g) == g`` exactly, and ``g - mean(g)`` is 0 before ``rstd`` amplifies it).  The
saved mean is the row's mean rounded to float (by Kiln's forward or ATen's): the row is
recentered on the exact mean ``mu + mean(d)`` (``sum(g * xhat)`` corrected by
``(c - mu) * sum(g)``, in double), so that ``xhat`` sums to zero as it should (a rounded mean
tilts every gradient of a near-constant row); a mean further than 4 ulp from the row's is used
as given, as ATen does.  The second pass computes ``dx`` and adds ``dy * xhat`` and ``dy`` into
per-thread float column sums, which are flushed into double every 16 rows and combined at the end.
Measured against float64 (random rows of 1-700 values, unit scale, near-constant and offset by
1e3) every result is at least as close as ATen's; on 4x64x128 and 8x128x256 the weight and bias
gradients 3-10x closer.  This replaced a kernel that did both passes in double: 1 thread,
4x64x128 rows (BERT's) 40 -> 21 us (ATen 22), 8x128x256 329 -> 188 us (ATen 174-185).

Same calling convention as every generated kernel (:mod:`kiln.codegen.cpp.emit`): ``P`` pointers (inputs, then outputs),
``I`` the iteration shape and then, per broadcast input, its strides.
"""

from __future__ import annotations

import re

import torch

from kiln.codegen.cpp.emit import PARALLEL_MIN, SAFELEN, KernelSpec, _mode
from kiln.ir.graph import In, Node
from kiln.ir.kernel import OutKind

F32 = torch.float32


def _is_f32(t) -> bool:
    return t is not None and t.dtype == F32


def layer_norm_ok(n: Node, in_types: list) -> bool:
    """Whether ``n`` is a layer norm (forward or backward) these kernels compute."""
    if n.op == "native_layer_norm.default":
        x, ns, w, b = n.args[0], n.args[1], n.args[2], n.args[3]
        if not all(a is None or isinstance(a, In) for a in (w, b)):
            return False
        if not isinstance(n.args[4], float) or not isinstance(x, In):
            return False
    elif n.op == "native_layer_norm_backward.default":
        if len(n.args) < 8 or len(n.args[7]) != 3:
            return False
        if not all(isinstance(a, In) for a in (n.args[0], n.args[1], n.args[3], n.args[4])):
            return False
        if not (n.args[5] is None or isinstance(n.args[5], In)):
            return False
        ns = n.args[2]
    else:
        return False
    if not (isinstance(ns, (list, tuple)) and len(ns) == 1 and isinstance(ns[0], (int, In))):
        return False
    size_in = ns[0].k if isinstance(ns[0], In) else None  # a symbolic normalized size's input
    tensors = [t for k, t in enumerate(in_types) if k != size_in]
    if not all(_is_f32(t) for t in tensors) or len(in_types) != len(n.inputs):
        return False
    shape = in_types[n.args[1].k if n.op.startswith("native_layer_norm_b") else n.args[0].k].shape
    if len(shape) < 1:
        return False
    # sizes may be symbolic (a shape-generic graph): the kernel reads every size at run time
    if size_in is not None:
        # ATen requires the normalized size to be x's last dim; a plain symbol is never 0 or 1
        # (Dynamo and the lazy device specialize those sizes)
        return in_types[size_in].py == "int" and re.fullmatch(r"s\d+", str(shape[-1])) is not None
    # a zero-size normalized dim (mean and rstd of nothing) is left to ATen
    return shape[-1] == ns[0] and ns[0] > 0


def emit_layer_norm(name: str, n: Node, in_types: list) -> tuple[str, KernelSpec]:
    """C++ source and call spec for one layer norm node (see :func:`layer_norm_ok`)."""
    if n.op == "native_layer_norm.default":
        return _forward(name, n, in_types)
    return _backward(name, n, in_types)


def _spec(
    name: str, n: Node, in_types: list, order: list[int], kind: str, out_kinds: list[OutKind]
) -> KernelSpec:
    shape = tuple(in_types[order[0]].shape)
    modes = [_mode(in_types[k].shape, shape) for k in order]
    return KernelSpec(
        name,
        kind,
        len(shape),
        shape,
        order,
        modes,
        [],
        out_kinds,
        out_dtypes=[F32] * len(out_kinds),
        members=(n.op,),
    )


def _head(name: str, spec: KernelSpec, names: list[str], n_out: int) -> list[str]:
    """Prologue: pointer names for inputs/outputs, sizes, and per-row offset code for
    broadcast inputs (returned as lines inside the row loop, indented 4)."""
    R = spec.rank
    L = [f'extern "C" void {name}(void** P, const int64_t* I, const double* D) {{']
    for p, nm in enumerate(names):
        L.append(f"  const float* {nm} = (const float*)P[{p}];")
    for o in range(n_out):
        L.append(f"  float* out{o} = (float*)P[{len(names) + o}];")
    for d in range(R):
        L.append(f"  const int64_t s{d} = I[{d}];")
    L.append(f"  const int64_t L = s{R - 1};")
    L.append("  const int64_t N = " + " * ".join(f"s{d}" for d in range(R)) + ";")
    if n_out == 3 and spec.out_kinds[1] is OutKind.COL:
        # backward over zero rows: the weight and bias gradients are sums over nothing
        L.append("  if (N == 0) {")
        L.append("    for (int64_t j = 0; j < L; ++j) { out1[j] = 0.0f; out2[j] = 0.0f; }")
        L.append("    return;")
        L.append("  }")
    else:
        L.append("  if (N == 0) return;")
    L.append("  const int64_t rows = N / L;")
    slot = R
    for p, m in enumerate(spec.input_modes):
        if m in ("bcast", "bcast_inner"):
            for d in range(R - 1):
                L.append(f"  const int64_t st{p}_{d} = I[{slot + d}];")
            slot += R
    return L


def _row_off(spec: KernelSpec, p: int) -> list[str]:
    """Lines computing ``off{p}``: element offset of row ``r`` in broadcast input ``p``."""
    R = spec.rank
    L = [f"    int64_t rem{p} = r;", f"    int64_t off{p} = 0;"]
    for d in range(R - 2, -1, -1):
        L.append(
            f"    {{ const int64_t id = rem{p} % s{d}; rem{p} /= s{d}; off{p} += id * st{p}_{d}; }}"
        )
    return L


def _forward(name: str, n: Node, in_types: list) -> tuple[str, KernelSpec]:
    x, w, b = n.args[0], n.args[2], n.args[3]
    order = [x.k] + [a.k for a in (w, b) if a is not None]
    names = ["x"] + [nm for nm, a in (("w", w), ("b", b)) if a is not None]
    spec = _spec(name, n, in_types, order, "layer_norm", [OutKind.FULL, OutKind.ROWK, OutKind.ROWK])
    shape = spec.static_shape
    for nm, a in (("weight", w), ("bias", b)):
        if a is not None and tuple(in_types[a.k].shape) != tuple(shape[-1:]):
            raise ValueError(f"layer norm: {nm} of shape {tuple(in_types[a.k].shape)}")
    eps = repr(float(n.args[4]))
    # x - mean as (x - m) - mc: m the float mean, mc what its rounding left out (module doc)
    y = "((xr[j] - m) - mc) * rstd"
    if w is not None:
        y = f"{y} * w[j]"
    if b is not None:
        y = f"{y} + b[j]"
    L = _head(name, spec, names, 3)
    L += [
        f"  #pragma omp parallel for if(N >= {PARALLEL_MIN})",
        "  for (int64_t r = 0; r < rows; ++r) {",
        "    const float* xr = x + r * L;",
        "    float* yr = out0 + r * L;",
        "    double s = 0.0;",
        f"    #pragma omp simd reduction(+:s) {SAFELEN}",
        "    for (int64_t j = 0; j < L; ++j) s += (double)xr[j];",
        "    const double mean = s / (double)L;",
        "    double v = 0.0;",
        f"    #pragma omp simd reduction(+:v) {SAFELEN}",
        "    for (int64_t j = 0; j < L; ++j) { const double d = (double)xr[j] - mean; v += d * d; }",
        f"    const float rstd = (float)(1.0 / __builtin_sqrt(v / (double)L + {eps}));",
        "    const float m = (float)mean;",
        "    const float mc = (float)(mean - (double)m);",
        "    #pragma omp simd",
        f"    for (int64_t j = 0; j < L; ++j) yr[j] = {y};",
        "    out1[r] = m;",
        "    out2[r] = rstd;",
        "  }",
        "}",
    ]
    src = "\n".join(L) + "\n"
    spec.source = src
    return src, spec


def _backward(name: str, n: Node, in_types: list) -> tuple[str, KernelSpec]:
    affine = n.args[5] is not None
    order = [n.args[i].k for i in ((0, 1, 3, 4, 5) if affine else (0, 1, 3, 4))]
    spec = _spec(
        name, n, in_types, order, "layer_norm_backward", [OutKind.FULL, OutKind.COL, OutKind.COL]
    )
    # dy and x: the iteration shape; mean and rstd: one value per row (ATen's stat shape);
    # weight: one per column.  Each read as its mode says (a one-element row makes mean/rstd
    # "full", a rank-1 x makes the weight "full" and mean/rstd "one")
    shape = tuple(spec.static_shape)
    shapes = [tuple(in_types[k].shape) for k in order]
    if (
        shapes[0] != shape
        or shapes[1] != shape
        or shapes[2] != shape[:-1] + (1,)
        or shapes[3] != shape[:-1] + (1,)
        or (affine and shapes[4] != shape[-1:])
    ):
        raise ValueError(f"layer norm backward: unexpected input shapes {shapes}")
    L = _head(name, spec, ["dy", "x", "mean", "rstd", "w"][: len(order)], 3)
    idx = {"one": "[0]", "full": "[r]", "bcast": "[off{p}]"}
    mi = "mean" + idx[spec.input_modes[2]].format(p=2)
    ri = "rstd" + idx[spec.input_modes[3]].format(p=3)
    g = "dyr[j] * w[j]" if affine else "dyr[j]"
    L += [
        "  double* tw = kiln_buf<double>(L, 1);",
        "  double* tb = kiln_buf<double>(L, 1);",
        f"  #pragma omp parallel if(N >= {PARALLEL_MIN})",
        "  {",
        "  double* pw = kiln_buf<double>(L, 1);",
        "  double* pb = kiln_buf<double>(L, 1);",
        "  float* fw = kiln_buf<float>(L, 1);",
        "  float* fb = kiln_buf<float>(L, 1);",
        "  int64_t blk = 0;",
        "  #pragma omp for schedule(static)",
        "  for (int64_t r = 0; r < rows; ++r) {",
    ]
    for p in (2, 3):
        if spec.input_modes[p] == "bcast":
            L += _row_off(spec, p)
    L += [
        f"    const float mu = {mi}, rs = {ri};",
        "    const float* dyr = dy + r * L;",
        "    const float* xr = x + r * L;",
        "    float* dxr = out0 + r * L;",
        "    // sums of d = x - mu, g * d (float) and g (double: exact for a row of equal g)",
        "    float sd = 0.0f, sgd = 0.0f;",
        "    double sg = 0.0;",
        f"    #pragma omp simd reduction(+:sd, sg, sgd) {SAFELEN}",
        "    for (int64_t j = 0; j < L; ++j) {",
        "      const float d = xr[j] - mu;",
        f"      const float g = {g};",
        "      sd += d;",
        "      sg += (double)g;",
        "      sgd += g * d;",
        "    }",
        "    // recenter on the row's exact mean where mu is its rounding (module doc)",
        "    const double md = (double)mu + (double)sd / (double)L;",
        "    const double c = __builtin_fabs(md - (double)mu) <= 4.8e-7 * __builtin_fabs(md)",
        "        ? md : (double)mu;",
        "    const double rsd = (double)rs;",
        "    const double sgx = rsd * ((double)sgd - (c - (double)mu) * sg);",
        "    const float mg = (float)(sg / (double)L), mgx = (float)(sgx / (double)L);",
        "    // x - c as (x - cf) - cc: cf the center rounded to float, cc what that left out",
        "    const float cf = (float)c, cc = (float)(c - (double)cf);",
        "    #pragma omp simd",
        "    for (int64_t j = 0; j < L; ++j) {",
        "      const float xh = ((xr[j] - cf) - cc) * rs;",
        f"      const float g = {g};",
        "      dxr[j] = rs * ((g - mg) - xh * mgx);",
        "      fw[j] += dyr[j] * xh;",
        "      fb[j] += dyr[j];",
        "    }",
        "    if (++blk == 16) {  // float column sums of at most 16 rows, then into double",
        "      blk = 0;",
        "      #pragma omp simd",
        "      for (int64_t j = 0; j < L; ++j) {",
        "        pw[j] += (double)fw[j]; pb[j] += (double)fb[j]; fw[j] = 0.0f; fb[j] = 0.0f;",
        "      }",
        "    }",
        "  }",
        "  for (int64_t j = 0; j < L; ++j) { pw[j] += (double)fw[j]; pb[j] += (double)fb[j]; }",
    ]
    L += [
        "  #pragma omp critical",
        "  {",
        "    for (int64_t j = 0; j < L; ++j) { tw[j] += pw[j]; tb[j] += pb[j]; }",
        "  }",
        "  kiln_free(pw);",
        "  kiln_free(pb);",
        "  kiln_free(fw);",
        "  kiln_free(fb);",
        "  }",
        "  for (int64_t j = 0; j < L; ++j) { out1[j] = (float)tw[j]; out2[j] = (float)tb[j]; }",
        "  kiln_free(tw);",
        "  kiln_free(tb);",
        "}",
    ]
    src = "\n".join(L) + "\n"
    spec.source = src
    return src, spec
