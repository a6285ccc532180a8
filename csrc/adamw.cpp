// AdamW on float32 master weights and a gradient's sum of squares (CPU): argument checks,
// then the vector kernels (adamw_simd.h, built per instruction set in simd.cpp) over spans
// of the tensors, spread over torch's threads.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace realhf {

namespace {

// Elements per task: a thread's share of a large tensor in spans of this size (a multiple of
// every vector width), and a small tensor on the calling thread.
constexpr int64_t kSpan = 65536;

}  // namespace

void adamw_step_cpu(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                    const torch::Tensor& grad, const c10::optional<torch::Tensor>& low,
                    double lr, double beta1, double beta2, double weight_decay, double eps,
                    double step, double grad_coef, const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  const char* fn = "adamw_step";
  const int64_t n = param.numel();
  for (const torch::Tensor* t : {&param, &exp_avg, &exp_avg_sq})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() &&
                    t->device().is_cpu() && t->numel() == n,
                fn, ": param, exp_avg and exp_avg_sq must be contiguous float32 CPU tensors "
                "of one size");
  TORCH_CHECK(float_or_bf16_cpu(grad) && grad.is_contiguous() && grad.numel() == n,
              fn, ": grad must be a contiguous float32 or bfloat16 CPU tensor of param's size");
  uint16_t* out = nullptr;
  if (low.has_value()) {
    TORCH_CHECK(low->scalar_type() == torch::kBFloat16 && low->is_contiguous() &&
                    low->device().is_cpu() && low->numel() == n,
                fn, ": low must be a contiguous bfloat16 CPU tensor of param's size");
    out = reinterpret_cast<uint16_t*>(low->data_ptr());
  }
  TORCH_CHECK_VALUE(step >= 1, fn, ": step must be >= 1 (the count after this step)");
  TORCH_CHECK_VALUE(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, fn,
                    ": betas must lie in [0, 1)");
  AdamWArgs a;
  a.grad_coef = static_cast<float>(grad_coef);
  a.decay = static_cast<float>(1.0 - lr * weight_decay);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.eps = static_cast<float>(eps);
  a.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, step)));
  a.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const char* g = static_cast<const char*>(grad.data_ptr());
  const bool g_bf16 = grad.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, (n + kSpan - 1) / kSpan, 1, [&](int64_t b0, int64_t b1) {
    kernels.adamw(p, m, v, g, g_bf16, out, b0 * kSpan, std::min(n, b1 * kSpan), a);
  });
}

double sum_squares_cpu(const torch::Tensor& x, const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  TORCH_CHECK(float_or_bf16_cpu(x) && x.is_contiguous(),
              "sum_squares: x must be a contiguous float32 or bfloat16 CPU tensor");
  const int64_t n = x.numel(), spans = (n + kSpan - 1) / kSpan;
  const char* p = static_cast<const char*>(x.data_ptr());
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  std::vector<double> part(spans);
  at::parallel_for(0, spans, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      part[b] = kernels.sum_squares(p, bf16, b * kSpan, std::min(n, (b + 1) * kSpan));
  });
  double total = 0;
  for (double v : part) total += v;
  return total;
}

}  // namespace realhf
