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

}  // namespace

torch::Tensor silu_mul_cpu(const torch::Tensor& gate, const torch::Tensor& up,
                           const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  check_like(up, gate, "up");
  auto out = torch::empty_like(gate);
  const int64_t n = gate.numel();
  const char* g = static_cast<const char*>(gate.data_ptr());
  const char* u = static_cast<const char*>(up.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  const bool bf16 = gate.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, (n + kSpan - 1) / kSpan, 1, [&](int64_t b0, int64_t b1) {
    kernels.silu_mul(g, u, o, b0 * kSpan, std::min(n, b1 * kSpan), bf16);
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
