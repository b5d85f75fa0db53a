// Which scaled-dot-product-attention kernel a kiln tensor gets: the CPU's choice.
//
// `scaled_dot_product_attention` asks a per-device-type stub which kernel to use; with nothing
// registered for the kiln device (PrivateUse1) it took the math path: the attention spelled out
// op by op, a (B, H, L, S) probability tensor and a `_safe_softmax` that Kiln runs through ATen.
// Here the kiln device gets the CPU's rules (`_fused_sdp_choice` redispatched to its CPU kernel,
// which reads only sizes, strides, dtypes and flags), so the step records
// `_scaled_dot_product_flash_attention_for_cpu` and its backward, as eager CPU and compile mode
// run them.  The recorded strides are eager's; the executors check the strides the kernels
// really get (kiln/codegen/cpp/aten_call.py, ARG_LAYOUT).
#pragma once

#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>

namespace {

inline int64_t sdp_choice_as_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& mask, double dropout_p,
                                 bool is_causal, std::optional<double> scale, bool enable_gqa) {
  return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), q, k,
                                                 v, mask, dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &sdp_choice_as_cpu)
}  // namespace at::native
