// kiln::matmul_strided for CPU (the schema, reference kernel and gradients: kiln/ir/matmul_strided.py).
//
// A batched product whose operands are read through their strides: MKL's grouped batch GEMM
// (cblas_sgemm_batch, one pointer per batch element) gets each operand's matrices as they lie,
// row-major or transposed with their own leading dim, so attention's per-head views of a
// projection's output need no copy; the result is written in the layout `order` asks for.
// Where that entry point is absent (a torch built without MKL), fails its first-use self-test,
// or the operands are not float32 with int-sized dims, the reference path runs: at::matmul,
// copied into the asked-for layout (correct, with the copies this op exists to avoid).

#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

namespace kiln_matmul {

// cblas_sgemm_batch with MKL's LP64 interface (MKL_INT = int, enums int-sized)
using BatchFn = void (*)(int, const int*, const int*, const int*, const int*, const int*,
                         const float*, const float**, const int*, const float**, const int*,
                         const float*, float**, const int*, int, const int*);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// A matrix (R x C, strides sr, sc) as BLAS reads it: row-major (lda >= C) or transposed
// (column-major, lda >= R); false where neither fits (then the operand is copied first).
inline bool blas_view(int64_t R, int64_t C, int64_t sr, int64_t sc, int& trans, int64_t& ld) {
  const int64_t c1 = std::max<int64_t>(1, C), r1 = std::max<int64_t>(1, R);
  if ((sc == 1 || C == 1) && (R == 1 || sr >= c1)) {
    trans = kNoTrans;
    ld = R == 1 ? c1 : sr;
    return true;
  }
  if ((sr == 1 || R == 1) && (C == 1 || sc >= r1)) {
    trans = kTrans;
    ld = C == 1 ? r1 : sc;
    return true;
  }
  return false;
}

inline BatchFn lookup() {
  void* h = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  void* f = h != nullptr ? dlsym(h, "cblas_sgemm_batch") : nullptr;
  if (f == nullptr) f = dlsym(RTLD_DEFAULT, "cblas_sgemm_batch");
  return reinterpret_cast<BatchFn>(f);
}

// One call of `fn` on a 2x3 @ 3x2 product, the left operand transposed: does it give the right
// numbers (the integer width and enum values as declared above)?
inline bool self_test(BatchFn fn) {
  const float at[6] = {1, 4, 2, 5, 3, 6};  // A = [[1,2,3],[4,5,6]] stored transposed (3 x 2)
  const float b[6] = {7, 8, 9, 10, 11, 12};  // B = [[7,8],[9,10],[11,12]]
  float c[4] = {-1, -1, -1, -1};
  const int ta = kTrans, tb = kNoTrans, m = 2, n = 2, k = 3, lda = 2, ldb = 2, ldc = 2, size = 1;
  const float alpha = 1.0f, beta = 0.0f;
  const float* ap = at;
  const float* bp = b;
  float* cp = c;
  fn(kRowMajor, &ta, &tb, &m, &n, &k, &alpha, &ap, &lda, &bp, &ldb, &beta, &cp, &ldc, 1, &size);
  return c[0] == 58 && c[1] == 64 && c[2] == 139 && c[3] == 154;
}

inline BatchFn batch_gemm() {
  static const BatchFn fn = [] {
    BatchFn f = lookup();
    return f != nullptr && self_test(f) ? f : nullptr;
  }();
  return fn;
}

inline std::vector<int64_t> checked_order(at::OptionalIntArrayRef order, int64_t n) {
  std::vector<int64_t> o;
  if (!order.has_value()) {
    for (int64_t d = 0; d < n; ++d) o.push_back(d);
    return o;
  }
  o.assign(order->begin(), order->end());
  std::vector<int64_t> s = o;
  std::sort(s.begin(), s.end());
  bool ok = static_cast<int64_t>(o.size()) == n && !o.empty() && o.back() == n - 1;
  for (int64_t d = 0; ok && d < n; ++d) ok = s[d] == d;
  TORCH_CHECK(ok, "matmul_strided: order ", order.value(),
              " is not a permutation of the operands' dims ending in the last");
  return o;
}

inline bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

inline at::Tensor matmul_strided_cpu(const at::Tensor& a, const at::Tensor& b,
                                     at::OptionalIntArrayRef order) {
  const int64_t nd = a.dim();
  TORCH_CHECK(nd >= 3 && b.dim() == nd, "matmul_strided takes two operands of the same rank >= 3, got ",
              a.dim(), " and ", b.dim());
  TORCH_CHECK(a.sizes().slice(0, nd - 2) == b.sizes().slice(0, nd - 2),
              "matmul_strided: batch dims differ: ", a.sizes(), " @ ", b.sizes());
  TORCH_CHECK(a.size(-1) == b.size(-2), "matmul_strided: ", a.sizes(), " @ ", b.sizes(),
              ": inner dims differ");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(),
              "matmul_strided: the operands' dtypes differ; convert one to the other's");
  const std::vector<int64_t> o = checked_order(order, nd);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape[nd - 1] = b.size(-1);
  std::vector<int64_t> phys(nd), inv(nd);
  for (int64_t i = 0; i < nd; ++i) {
    phys[i] = shape[o[i]];
    inv[o[i]] = i;
  }
  at::Tensor out = at::empty(phys, a.options()).permute(inv);
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  if (out.numel() == 0) return out;
  if (K == 0) return out.zero_();
  auto reference = [&]() -> at::Tensor {  // at::matmul, copied into the asked-for layout
    out.copy_(at::matmul(a, b));
    return out;
  };
  BatchFn fn = a.scalar_type() == at::kFloat ? batch_gemm() : nullptr;
  if (fn == nullptr || !fits_int(M) || !fits_int(N) || !fits_int(K)) return reference();
  at::Tensor x = a, y = b;
  int ta = 0, tb = 0;
  int64_t lda = 0, ldb = 0;
  if (!blas_view(M, K, x.stride(-2), x.stride(-1), ta, lda)) {
    x = x.contiguous();
    blas_view(M, K, x.stride(-2), x.stride(-1), ta, lda);
  }
  if (!blas_view(K, N, y.stride(-2), y.stride(-1), tb, ldb)) {
    y = y.contiguous();
    blas_view(K, N, y.stride(-2), y.stride(-1), tb, ldb);
  }
  const int64_t ldc = M == 1 ? std::max<int64_t>(1, N) : out.stride(-2);
  int64_t batch = 1;
  for (int64_t d = 0; d < nd - 2; ++d) batch *= shape[d];
  if (!fits_int(lda) || !fits_int(ldb) || !fits_int(ldc) || !fits_int(batch)) return reference();
  std::vector<const float*> ap(batch), bp(batch);
  std::vector<float*> cp(batch);
  const float* xa = x.data_ptr<float>();
  const float* yb = y.data_ptr<float>();
  float* oc = out.data_ptr<float>();
  std::vector<int64_t> idx(nd - 2, 0);
  for (int64_t i = 0; i < batch; ++i) {
    int64_t offa = 0, offb = 0, offc = 0;
    for (int64_t d = 0; d < nd - 2; ++d) {
      offa += idx[d] * x.stride(d);
      offb += idx[d] * y.stride(d);
      offc += idx[d] * out.stride(d);
    }
    ap[i] = xa + offa;
    bp[i] = yb + offb;
    cp[i] = oc + offc;
    for (int64_t d = nd - 3; d >= 0; --d) {  // next batch index, last dim fastest
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  const int m = static_cast<int>(M), n = static_cast<int>(N), k = static_cast<int>(K);
  const int ilda = static_cast<int>(lda), ildb = static_cast<int>(ldb), ildc = static_cast<int>(ldc);
  const int size = static_cast<int>(batch);
  const float alpha = 1.0f, beta = 0.0f;
  fn(kRowMajor, &ta, &tb, &m, &n, &k, &alpha, ap.data(), &ilda, bp.data(), &ildb, &beta, cp.data(),
     &ildc, 1, &size);
  return out;
}

}  // namespace kiln_matmul

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("matmul_strided", &kiln_matmul::matmul_strided_cpu); }
