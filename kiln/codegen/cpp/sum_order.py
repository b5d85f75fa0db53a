"""Sums added in the order ATen's CPU kernels add them: column sums (``cols`` kernels, the C++
helpers in :data:`SOURCE`, in the order of ATen's ``sum``) and softmax row sums
(:func:`softmax_row_sum`, in the order of ATen's softmax kernels).

A float32 sum is exact only up to its order of additions, and a bias gradient (the sum of a
``[rows, L]`` gradient over its rows) reached the optimizer a last bit off eager's in most columns
when Kiln summed in double: AdamW then turns a last-bit difference into a visible one over tens of
steps (the CNN of ``bench/`` drifted 1.6e-5 from eager's loss by step 43).  These helpers add each
column's float values in the order of ATen's ``sum`` on the CPU (``cascade_sum``), so a fused sum
gives eager's bits when its summands are eager's:

- one column's values are added in a cascade: runs of ``2^p`` values (``p = max(4,
  ceil(log2 n) / 4)``) into a level-0 accumulator, carried into level 1 after each run, level 1
  into level 2 after ``2^p`` runs, and so on over 4 levels, the levels added up at the end
  (``straight``);
- ATen's kernel takes its columns in vectors of 8 floats (its AVX2 build: ``sum`` has no AVX-512
  one): the columns in whole blocks of 32 (4 vectors; with fewer than 8 columns, groups of 4) run
  the straight cascade; the others (``interleaved``) split their rows into 4 lanes (row ``4g +
  k`` into lane ``k``), cascade each lane over ``rows / 4`` steps, add the rows left over to lane
  0, then add lanes 1, 2 and 3 to it;
- from 32768 elements on (with more than one thread) ATen splits the columns between its threads
  (``ceil(L / threads)`` each, boundaries rounded down to multiples of 32), and each thread's
  block is taken as above from its own first column: the kernel splits them the same way, with
  the thread count torch uses (the same OpenMP runtime);
- one column (``L == 1``): ATen reduces all the elements as one row: vectors of 8 consecutive
  values, 4 vectors a step (32 accumulators, the cascade over ``rows / 32`` steps), the vectors
  left over added to the first, the elements past the last whole vector summed first, then the 8
  lanes; from 32768 elements on with more threads, each thread's contiguous share that way and
  the threads' partial sums (one slot per thread of torch's pool, unused ones 0) summed as a row
  of their own.

Every sum ends as ``0 + s`` (ATen adds into an output it zeroed: a -0 sum is +0).  Checked against
``torch.sum`` over shapes on each branch, 1 and 2 threads (tests/codegen/test_sum_order.py).
Kernels that use them include :data:`SOURCE` (guarded, once per translation unit).
"""

from __future__ import annotations

import functools

import torch

GRAIN = 32768  # ATen's internal::GRAIN_SIZE: from here on a reduction runs on several threads
VEC = 8  # floats per vector in ATen's sum kernel
ROUND = 32  # thread boundaries between columns: multiples of 128 bytes of floats


@functools.cache
def softmax_lanes() -> tuple[int, bool]:
    """(vector width, shuffle tree) of ATen's softmax / log-softmax row sums on this machine:
    those kernels have AVX-512 builds (16 floats, lanes added pairwise by a shuffle tree; checked
    against eager on rows of 5 to 1000), AVX2 ones (8 floats, a tree); the generic build adds
    its 8 lanes in order."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return 16, True
    if cap == "AVX2":
        return 8, True
    return 8, False


def softmax_row_sum(value: str, indent: str) -> list[str]:
    """C++ lines declaring ``float s``: the sum of ``value`` (``{j}`` the column, ``L`` the row
    length) over the row, added in the order of ATen's softmax kernels (``vec::reduce_all``,
    ``map_reduce_all``, ``map2_reduce_all``: forward and backward): with at least one vector's
    worth, lane ``l`` of a vector accumulator takes columns ``l``, ``l + W``, ... and the last
    partial vector goes into the first lanes; then the lanes are added pairwise, halves first
    (its shuffle tree), or in order where ATen's build has no tree.  A row shorter than a vector
    is added in order.  ``W`` and the tree: :func:`softmax_lanes`."""
    lanes, tree = softmax_lanes()
    v = value.format
    out = [
        "float s;",
        f"if (L < {lanes}) {{",
        f"  s = {v(j='0')};",
        f"  for (int64_t j = 1; j < L; ++j) s += {v(j='j')};",
        "} else {",
        # the accumulator is a vector register (GCC's vector extension); each step's values are
        # computed by a vectorized loop into a vector-sized buffer, then added as one vector
        f"  typedef float kv __attribute__((vector_size({4 * lanes})));",
        "  kv acc, t;",
        "  #pragma omp simd",
        f"  for (int l = 0; l < {lanes}; ++l) t[l] = {v(j='l')};",
        "  acc = t;",
        f"  int64_t j0 = {lanes};",
        f"  for (; j0 + {lanes} <= L; j0 += {lanes}) {{",
        "    #pragma omp simd",
        f"    for (int l = 0; l < {lanes}; ++l) t[l] = {v(j='j0 + l')};",
        "    acc += t;",
        "  }",
        # the last partial vector into the first lanes (its values by a vectorized loop: a row
        # of 1000 spent 10% of its time on 8 scalar exps)
        "  const int n0 = (int)(L - j0);",
        "  if (n0 > 0) {",
        f"    float tt[{lanes}];",
        "    #pragma omp simd",
        f"    for (int l = 0; l < n0; ++l) tt[l] = {v(j='j0 + l')};",
        "    for (int l = 0; l < n0; ++l) acc[l] += tt[l];",
        "  }",
    ]
    if tree:  # lane i + lane i ^ h, h = W/2 .. 1, as shuffles of the register
        out.append(f"  typedef int ki __attribute__((vector_size({4 * lanes})));")
        h = lanes // 2
        while h >= 1:
            mask = ", ".join(str(i ^ h) for i in range(lanes))
            out.append(f"  acc += __builtin_shuffle(acc, (ki){{{mask}}});")
            h //= 2
        out.append("  s = acc[0];")
    else:
        out += ["  s = acc[0];", f"  for (int l = 1; l < {lanes}; ++l) s += acc[l];"]
    out.append("}")
    return [indent + line for line in out]


SOURCE = r"""
#ifndef KILN_COL_SUMS_H
#define KILN_COL_SUMS_H
// A cascade of w accumulators over n steps, in four levels (see kiln/codegen/cpp/sum_order.py).
struct kiln_casc {
  int64_t w, lp, full, done;
  float* a;  // [4][w]
};
static inline void kiln_casc_init(kiln_casc* c, int64_t w, int64_t n) {
  const int64_t cl = n <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(n - 1));  // ceil(log2 n)
  c->w = w;
  c->lp = cl / 4 > 4 ? cl / 4 : 4;
  c->full = (n >> c->lp) << c->lp;
  c->done = 0;
  c->a = kiln_buf<float>(4 * (w > 0 ? w : 1), 1);
}
static inline void kiln_casc_add(kiln_casc* c, const float* x, int64_t off, int64_t m) {
  float* a0 = c->a + off;
  #pragma omp simd
  for (int64_t k = 0; k < m; ++k) a0[k] += x[k];
}
static inline void kiln_casc_next(kiln_casc* c) {
  const int64_t d = ++c->done, mask = ((int64_t)1 << c->lp) - 1;
  if (d > c->full || (d & mask) != 0) return;
  for (int l = 1; l < 4; ++l) {
    float* lo = c->a + (l - 1) * c->w;
    float* hi = c->a + l * c->w;
    #pragma omp simd
    for (int64_t k = 0; k < c->w; ++k) { hi[k] += lo[k]; lo[k] = 0.0f; }
    if ((d & (mask << (l * c->lp))) != 0) break;
  }
}
static inline float kiln_casc_total(const kiln_casc* c, int64_t k) {
  const float* a = c->a;
  float s = a[k];
  s += a[c->w + k];
  s += a[2 * c->w + k];
  s += a[3 * c->w + k];
  return s;
}
// The sum of x[0..n) as ATen sums one contiguous row (its inner sum, vectors of 8): with at least
// one vector, 32 accumulators (4 vectors) take the elements 32 at a time through the cascade, the
// vectors left over go into the first 8, the 4 vectors are added lane by lane, then the elements
// past the last whole vector are summed from 0 and the 8 lanes added to them; a shorter row runs
// the interleaved form of 4 lanes.  rows == 1 with 32768 elements or more and pool > 1 threads:
// ATen splits the row between its threads and sums their partial sums as a row of pool values.
typedef float kiln_v8 __attribute__((vector_size(32)));  // ATen's float vector in its sum kernel
static inline kiln_v8 kiln_load8(const float* p) {
  kiln_v8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
static inline float kiln_inner_sum1(const float* x, int64_t n) {
  if (n < 8) {
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t ng = n / 4;  // (at most one group of 4: the cascade never carries)
    for (int64_t g = 0; g < ng; ++g)
      for (int k = 0; k < 4; ++k) p[k] += x[4 * g + k];
    for (int64_t e = 4 * ng; e < n; ++e) p[0] += x[e];
    float r = p[0];
    r += p[1];
    r += p[2];
    r += p[3];
    return r;
  }
  const int64_t nv = n / 8, ng = nv / 4;
  const int64_t cl = ng <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(ng - 1));
  const int64_t lp = cl / 4 > 4 ? cl / 4 : 4, mask = ((int64_t)1 << lp) - 1;
  kiln_v8 A[4];
  if (ng <= mask) {  // fewer groups than one run: no carry, the upper levels stay 0 (x + 0 == x)
    A[0] = A[1] = A[2] = A[3] = kiln_v8{};
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = x + 32 * g;
      A[0] += kiln_load8(xg);
      A[1] += kiln_load8(xg + 8);
      A[2] += kiln_load8(xg + 16);
      A[3] += kiln_load8(xg + 24);
    }
    // (a -0 lane stays -0 where ATen's + 0 makes it +0: the sum starts from +0 below either way)
  } else {  // runs of 2^lp groups into level 0, each run carried up (levels 1..3 in lv)
    kiln_v8 a0[4], lv[3][4];
    for (int k = 0; k < 4; ++k) a0[k] = lv[0][k] = lv[1][k] = lv[2][k] = kiln_v8{};
    const int64_t step = mask + 1;
    int64_t g = 0;
    while (g + step <= ng) {
      kiln_v8 t0 = a0[0], t1 = a0[1], t2 = a0[2], t3 = a0[3];
      for (const int64_t e = g + step; g < e; ++g) {
        const float* xg = x + 32 * g;
        t0 += kiln_load8(xg);
        t1 += kiln_load8(xg + 8);
        t2 += kiln_load8(xg + 16);
        t3 += kiln_load8(xg + 24);
      }
      a0[0] = t0, a0[1] = t1, a0[2] = t2, a0[3] = t3;
      for (int l = 1; l < 4; ++l) {
        kiln_v8* lo = l == 1 ? a0 : lv[l - 2];
        for (int k = 0; k < 4; ++k) {
          lv[l - 1][k] += lo[k];
          lo[k] = kiln_v8{};
        }
        if ((g & (mask << (l * lp))) != 0) break;
      }
    }
    for (; g < ng; ++g) {
      const float* xg = x + 32 * g;
      for (int k = 0; k < 4; ++k) a0[k] += kiln_load8(xg + 8 * k);
    }
    for (int k = 0; k < 4; ++k) A[k] = ((a0[k] + lv[0][k]) + lv[1][k]) + lv[2][k];
  }
  for (int64_t v = 4 * ng; v < nv; ++v) A[0] += kiln_load8(x + 8 * v);
  const kiln_v8 P = ((A[0] + A[1]) + A[2]) + A[3];
  float r = 0.0f;
  for (int64_t e = 8 * nv; e < n; ++e) r += x[e];
  for (int l = 0; l < 8; ++l) r += P[l];
  return r;
}
static inline float kiln_inner_sum(const float* x, int64_t n, int64_t rows, int64_t pool) {
  if (rows != 1 || n < 32768 || pool < 2) return 0.0f + kiln_inner_sum1(x, n);
  const int64_t want = (n + 32767) / 32768, nt = want < pool ? want : pool;
  const int64_t ch = (n + nt - 1) / nt;
  float* parts = kiln_buf<float>(pool, 1);
  for (int64_t t = 0; t < nt && t * ch < n; ++t) {
    const int64_t e = (t + 1) * ch < n ? (t + 1) * ch : n;
    parts[t] = 0.0f + kiln_inner_sum1(x + t * ch, e - t * ch);
  }
  const float r = 0.0f + kiln_inner_sum1(parts, pool);
  kiln_free(parts);
  return r;
}
// This thread's columns [*cb, *ce) of L, as ATen splits an outer sum between its threads.
static inline int kiln_col_range(int64_t L, int64_t* cb, int64_t* ce) {
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
  if (nt == 1 || L == 1) {
    *cb = 0;
    *ce = t == 0 ? L : 0;
    return t == 0;
  }
  const int64_t used = nt < L ? nt : L, ch = (L + used - 1) / used;
  if (t >= used || t * ch >= L) return 0;
  int64_t b = t * ch, e = b + ch < L ? b + ch : L;
  b -= b % 32;
  if (e != L) e -= e % 32;
  *cb = b;
  *ce = e;
  return b < e;
}
// The sums of columns [cb, ce) of a [rows, L] stream of rows.
struct kiln_col_sums {
  int64_t rows, n, ns, ni, ng;
  kiln_casc s, it;
  float* lanes;  // [4][ni] once the interleaved cascade is over
  int combined;
  // L == 1
  int single;
  int64_t pool;
  float* col;  // L == 1: the column's values, summed at the end as ATen sums one row
};
// pool: the threads torch reduces with (omp_get_max_threads() outside any parallel region)
static inline void kiln_col_sums_init(kiln_col_sums* c, int64_t rows, int64_t L, int64_t cb,
                                      int64_t ce, int64_t pool) {
  c->rows = rows;
  c->single = L == 1;
  if (c->single) {
    c->pool = pool;
    c->col = kiln_buf<float>(rows, 0);
    return;
  }
  c->n = ce - cb;
  c->ns = c->n >= 8 ? c->n / 32 * 32 : c->n / 4 * 4;
  c->ni = c->n - c->ns;
  c->ng = rows / 4;
  kiln_casc_init(&c->s, c->ns, rows);
  kiln_casc_init(&c->it, 4 * c->ni, c->ng);
  c->lanes = kiln_buf<float>(4 * (c->ni > 0 ? c->ni : 1), 1);
  c->combined = 0;
}
static inline void kiln_col_sums_lanes(kiln_col_sums* c) {
  for (int64_t k = 0; k < 4 * c->ni; ++k) c->lanes[k] = kiln_casc_total(&c->it, k);
  c->combined = 1;
}
static inline void kiln_col_sums_add(kiln_col_sums* c, int64_t r, const float* q) {
  if (c->single) {
    c->col[r] = q[0];
    return;
  }
  if (c->ns) {
    kiln_casc_add(&c->s, q, 0, c->ns);
    kiln_casc_next(&c->s);
  }
  if (!c->ni) return;
  if (r < 4 * c->ng) {
    kiln_casc_add(&c->it, q + c->ns, (r % 4) * c->ni, c->ni);
    if (r % 4 == 3) kiln_casc_next(&c->it);
  } else {
    if (!c->combined) kiln_col_sums_lanes(c);
    float* l0 = c->lanes;
    const float* x = q + c->ns;
    #pragma omp simd
    for (int64_t k = 0; k < c->ni; ++k) l0[k] += x[k];
  }
}
static inline void kiln_col_sums_finish(kiln_col_sums* c, float* out) {
  if (c->single) {
    out[0] = kiln_inner_sum(c->col, c->rows, 1, c->pool);
    kiln_free(c->col);
    return;
  }
  for (int64_t k = 0; k < c->ns; ++k) out[k] = 0.0f + kiln_casc_total(&c->s, k);
  if (c->ni) {
    if (!c->combined) kiln_col_sums_lanes(c);
    const float* l = c->lanes;
    for (int64_t k = 0; k < c->ni; ++k) {
      float t = l[k];
      t += l[c->ni + k];
      t += l[2 * c->ni + k];
      t += l[3 * c->ni + k];
      out[c->ns + k] = 0.0f + t;
    }
  }
  kiln_free(c->s.a);
  kiln_free(c->it.a);
  kiln_free(c->lanes);
}
#endif
"""
