"""Generated kernel for ``t_copy`` (a 2-D float32 tensor's transpose, written contiguous).

ATen's ``t_copy`` (and ``x.t().contiguous()``) walks the output in order and reads the input one
element at a time down its columns: 628 us for a 1024 x 1024 float32 tensor on 2 threads here.
This kernel moves 32 x 32 tiles, the tiles shared by the threads, each as 16 x 16 blocks
transposed in AVX-512 registers (8 x 8 blocks in AVX registers where there is no AVX-512):
112 us for the same tensor (8 x 8 blocks: 244), 22 us for 1024 x 256 (ATen 157, 8 x 8: 61),
103 us for 512 x 2048 (ATen 596, 8 x 8: 140).  A 16 x 16 block reads and writes whole 64-byte
cache lines, each once; with 8 x 8 blocks a line is read (or written) half at a time, and with a
power-of-two row length all rows of a tile fall into the same L1 set, so the second half often
comes from L2 again.  Partial tiles at the edges, and machines without AVX, copy element by
element.  The values are copied, never computed, so the result is ATen's bit for bit.

It exists for :mod:`kiln.passes.gemm_library`, which feeds oneDNN a weight gradient's ``dY^T``
row-major.  Same calling convention as every generated kernel (:mod:`kiln.codegen.cpp.emit`):
``P = {x, out}``, ``I = {rows, cols}`` of ``x``; the output's shape is ``OutKind.TRANS`` of that.
"""

from __future__ import annotations

import torch

from kiln.codegen.cpp.emit import PARALLEL_MIN, KernelSpec
from kiln.ir.graph import In, Node
from kiln.ir.kernel import OutKind

OP = "t_copy.default"
TILE = 32  # tile edge: 32 x 32 floats is 4 KiB of input and 4 KiB of output, inside L1


def _avx512_block() -> str:
    """A 16 x 16 block of floats transposed in sixteen AVX-512 registers: unpack pairs of rows,
    shuffle within 128-bit lanes, then exchange 128-bit lanes twice (64 shuffles in all)."""
    L = ["static inline void kiln_t16x16(const float* in, int64_t ldi, float* out, int64_t ldo) {"]
    L.append("  __m512 r[16], t[16];")
    L += [f"  r[{i}] = _mm512_loadu_ps(in + {i} * ldi);" for i in range(16)]
    for k in range(0, 16, 2):
        L.append(f"  t[{k}] = _mm512_unpacklo_ps(r[{k}], r[{k + 1}]);")
        L.append(f"  t[{k + 1}] = _mm512_unpackhi_ps(r[{k}], r[{k + 1}]);")
    for a in range(0, 16, 4):
        for lo, x, y in ((a, a, a + 2), (a + 2, a + 1, a + 3)):
            L.append(f"  r[{lo}] = _mm512_shuffle_ps(t[{x}], t[{y}], 0x44);")
            L.append(f"  r[{lo + 1}] = _mm512_shuffle_ps(t[{x}], t[{y}], 0xEE);")
    for k in (0, 1, 2, 3, 8, 9, 10, 11):
        L.append(f"  t[{k}] = _mm512_shuffle_f32x4(r[{k}], r[{k + 4}], 0x88);")
        L.append(f"  t[{k + 4}] = _mm512_shuffle_f32x4(r[{k}], r[{k + 4}], 0xdd);")
    for k in range(8):
        L.append(f"  r[{k}] = _mm512_shuffle_f32x4(t[{k}], t[{k + 8}], 0x88);")
        L.append(f"  r[{k + 8}] = _mm512_shuffle_f32x4(t[{k}], t[{k + 8}], 0xdd);")
    L += [f"  _mm512_storeu_ps(out + {i} * ldo, r[{i}]);" for i in range(16)]
    return "\n".join(L + ["}"])


_SOURCE = (
    r"""
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define KILN_TB 16
"""
    + _avx512_block()
    + r"""
#define KILN_TBLOCK kiln_t16x16
#elif defined(__AVX__)
#define KILN_TB 8
// An 8 x 8 block of floats, rows ``ldi`` apart, written transposed, rows ``ldo`` apart.
static inline void kiln_t8x8(const float* in, int64_t ldi, float* out, int64_t ldo) {
  const __m256 r0 = _mm256_loadu_ps(in), r1 = _mm256_loadu_ps(in + ldi),
               r2 = _mm256_loadu_ps(in + 2 * ldi), r3 = _mm256_loadu_ps(in + 3 * ldi),
               r4 = _mm256_loadu_ps(in + 4 * ldi), r5 = _mm256_loadu_ps(in + 5 * ldi),
               r6 = _mm256_loadu_ps(in + 6 * ldi), r7 = _mm256_loadu_ps(in + 7 * ldi);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
               t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
               t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE),
               s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE),
               s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE),
               s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(out + ldo, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(out + 2 * ldo, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(out + 3 * ldo, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(out + 4 * ldo, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(out + 5 * ldo, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(out + 6 * ldo, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(out + 7 * ldo, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#define KILN_TBLOCK kiln_t8x8
#endif
extern "C" void KILN_KERNEL(void** P, const int64_t* I, const double* D) {
  const float* x = (const float*)P[0];
  float* y = (float*)P[1];
  const int64_t R = I[0], C = I[1];
  const int64_t B = TILE;
  const int64_t nbi = (R + B - 1) / B, nbj = (C + B - 1) / B;
  #pragma omp parallel for if(R * C >= PARALLEL_MIN)
  for (int64_t b = 0; b < nbi * nbj; ++b) {
    const int64_t i0 = (b / nbj) * B, j0 = (b % nbj) * B;
    const int64_t i1 = i0 + B < R ? i0 + B : R, j1 = j0 + B < C ? j0 + B : C;
#if defined(KILN_TBLOCK)
    if (i1 - i0 == B && j1 - j0 == B) {
      for (int64_t i = i0; i < i1; i += KILN_TB)
        for (int64_t j = j0; j < j1; j += KILN_TB)
          KILN_TBLOCK(x + i * C + j, C, y + j * R + i, R);
      continue;
    }
#endif
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t i = i0; i < i1; ++i) y[j * R + i] = x[i * C + j];
  }
}
#undef KILN_TB
#undef KILN_TBLOCK
"""
)


def t_copy_ok(n: Node, in_types: list) -> bool:
    """Whether ``n`` is a ``t_copy`` of a 2-D float32 tensor (sizes may be symbolic)."""
    if n.op != OP or n.args != (In(0),) or n.kwargs or len(in_types) != 1:
        return False
    t = in_types[0]
    return t is not None and t.dtype == torch.float32 and len(t.shape) == 2


def emit_t_copy(name: str, n: Node, in_types: list) -> tuple[str, KernelSpec]:
    """C++ source and call spec for one node accepted by :func:`t_copy_ok`."""
    spec = KernelSpec(
        name,
        "transpose",
        2,
        tuple(in_types[0].shape),
        [0],
        ["full"],
        [],
        [OutKind.TRANS],
        out_dtypes=[torch.float32],
        members=(n.op,),
    )
    src = (
        _SOURCE.replace("KILN_KERNEL", name)
        .replace("PARALLEL_MIN", str(PARALLEL_MIN))
        .replace("= TILE;", f"= {TILE};")
    )
    spec.source = src
    return src, spec
