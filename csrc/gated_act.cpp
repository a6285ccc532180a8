// The gated MLP's silu(gate) * up and its gradients (CPU): argument checks, then the vector
// kernels (gated_act_simd.h, built per instruction set in simd.cpp) over spans of the
// tensors, spread over torch's threads.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "simd.h"

namespace realhf {

namespace {

constexpr int64_t kSpan = 16384;  // elements per task (a multiple of every vector width)

void check_like(const torch::Tensor& t, const torch::Tensor& gate, const char* name) {
  TORCH_CHECK(float_or_bf16_cpu(gate) && gate.is_contiguous(),
              "silu_mul: gate must be a contiguous float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.scalar_type() == gate.scalar_type() && t.sizes() == gate.sizes() &&
                  t.is_contiguous() && t.device().is_cpu(),
              "silu_mul: ", name, " must be a contiguous CPU tensor of gate's shape and dtype");
}

// Rows of gate and up, each contiguous but with any row stride (the two halves of a fused
// [T, 2F] gate/up product): 2-D, of one shape and dtype.
void check_rows(const torch::Tensor& gate, const torch::Tensor& up) {
  for (const torch::Tensor* t : {&gate, &up})
    TORCH_CHECK(float_or_bf16_cpu(*t) && t->dim() == 2 && t->stride(1) == 1 &&
                    t->scalar_type() == gate.scalar_type() && t->sizes() == gate.sizes(),
                "silu_mul: gate and up must be contiguous float32 or bfloat16 CPU tensors of "
                "one shape and dtype, or [T, F] ones of that kind with contiguous rows");
}

}  // namespace

torch::Tensor silu_mul_cpu(const torch::Tensor& gate, const torch::Tensor& up,
                           const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  const bool flat = gate.is_contiguous() && up.is_contiguous();
  if (flat)
    check_like(up, gate, "up");
  else
    check_rows(gate, up);
  auto out = torch::empty(gate.sizes(), gate.options());
  const char* g = static_cast<const char*>(gate.data_ptr());
  const char* u = static_cast<const char*>(up.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const bool bf16 = gate.scalar_type() == torch::kBFloat16;
  if (flat) {
    const int64_t n = gate.numel();
    at::parallel_for(0, (n + kSpan - 1) / kSpan, 1, [&](int64_t b0, int64_t b1) {
      kernels.silu_mul(g, u, o, b0 * kSpan, std::min(n, b1 * kSpan), bf16);
    });
    return out;
  }
  const int64_t F = gate.size(1), es = gate.element_size();
  const int64_t gs = gate.stride(0) * es, us = up.stride(0) * es;
  at::parallel_for(0, gate.size(0), std::max<int64_t>(1, kSpan / std::max<int64_t>(F, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r)
                       kernels.silu_mul(g + r * gs, u + r * us, o + r * F * es, 0, F, bf16);
                   });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> silu_mul_backward_cpu(const torch::Tensor& gate,
                                                               const torch::Tensor& up,
                                                               const torch::Tensor& grad_out,
                                                               const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  check_like(up, gate, "up");
  check_like(grad_out, gate, "grad_out");
  auto d_gate = torch::empty_like(gate);
  auto d_up = torch::empty_like(gate);
  const int64_t n = gate.numel();
  const char* g = static_cast<const char*>(gate.data_ptr());
  const char* u = static_cast<const char*>(up.data_ptr());
  const char* dy = static_cast<const char*>(grad_out.data_ptr());
  char* dg = static_cast<char*>(d_gate.data_ptr());
  char* du = static_cast<char*>(d_up.data_ptr());
  const bool bf16 = gate.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, (n + kSpan - 1) / kSpan, 1, [&](int64_t b0, int64_t b1) {
    kernels.silu_mul_grad(g, u, dy, dg, du, b0 * kSpan, std::min(n, b1 * kSpan), bf16);
  });
  return {d_gate, d_up};
}

}  // namespace realhf
