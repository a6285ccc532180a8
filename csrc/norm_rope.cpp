// RMSNorm and rotary embedding for inference (CPU): argument checks, then the vector kernels
// (norm_rope_simd.h, built per instruction set in simd.cpp, which says what they compute and
// how they round) over the rows, spread over torch's threads.
#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace realhf {

torch::Tensor rms_norm_cpu(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                           const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  const auto dt = x.scalar_type();
  TORCH_CHECK(float_or_bf16_cpu(x) && x.is_contiguous() && x.dim() >= 1,
              "rms_norm: x must be a contiguous float32 or bfloat16 CPU tensor");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == D,
              "rms_norm: weight must be a contiguous [D] tensor of x's dtype");
  auto out = torch::empty_like(x);
  const int64_t rows = D ? x.numel() / D : 0;
  const int64_t elem = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(weight.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  const bool bf16 = dt == torch::kBFloat16;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
                     const int64_t off = r0 * D * elem;
                     kernels.rms_norm(xp + off, wp, op + off, r1 - r0, D, e, bf16);
                   });
  return out;
}

torch::Tensor rope_cpu(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  const auto dt = x.scalar_type();
  TORCH_CHECK(float_or_bf16_cpu(x) && x.dim() == 3 && x.stride(2) == 1,
              "rope: x must be a float32 or bfloat16 CPU tensor [T, H, D] with its last dim "
              "contiguous");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "rope: the head size must be even, got ", D);
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == dt && t->dim() == 3 && t->size(0) == T && t->size(1) == 1 &&
                    t->size(2) == D && t->stride(2) == 1 && t->stride(0) == cos.stride(0),
                "rope: cos and sin must be [T, 1, D] tensors of x's dtype, last dim "
                "contiguous, with the same strides");
  }
  auto out = torch::empty({T, H, D}, x.options());
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* cp = static_cast<const char*>(cos.data_ptr());
  const char* sp = static_cast<const char*>(sin.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t sT = x.stride(0), sH = x.stride(1), sC = cos.stride(0);
  const bool bf16 = dt == torch::kBFloat16;
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * D, 1)),
                   [&](int64_t t0, int64_t t1) {
                     kernels.rope(xp, sT, sH, cp, sp, sC, op, t0, t1, H, D, bf16);
                   });
  return out;
}

}  // namespace realhf
