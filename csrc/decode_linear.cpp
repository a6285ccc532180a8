// x @ W.T for the few rows of a decode step (float32, CPU): argument checks, then the vector
// kernels (decode_linear_simd.h, built per instruction set in simd.cpp) over blocks of 16
// output columns, spread over torch's threads.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "simd.h"

namespace realhf {

torch::Tensor decode_linear_cpu(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias, int64_t n_out,
                                const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  const char* fn = "decode_linear";
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.dim() == 2, fn,
              ": x must be a float32 CPU tensor [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat32 && packed.device().is_cpu() &&
                  packed.is_contiguous() && packed.dim() == 3 && packed.size(2) == 16,
              fn, ": packed must be a contiguous float32 CPU tensor [ceil(N / 16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, fn, ": x has ", K, " columns but packed was made from ",
              packed.size(1));
  TORCH_CHECK_VALUE(n_out > (NB - 1) * 16 && n_out <= NB * 16, fn, ": n_out ", n_out,
                    " does not fit ", NB, " packed blocks of 16 columns");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->device().is_cpu() && bias->numel() == NB * 16,
                fn, ": bias must be a contiguous float32 CPU tensor of ceil(N / 16) * 16");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, n_out}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || n_out == 0) return y;
  const auto xt = x.t().contiguous();  // [K, M]: a k's M values side by side
  const float* X = xt.data_ptr<float>();
  const float* P = packed.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    kernels.decode_linear(X, M, P, b, Y, n_out, K, b0, b1);
  });
  return y;
}

}  // namespace realhf
