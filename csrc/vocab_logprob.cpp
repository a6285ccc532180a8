// Log-softmax statistics and gradients of selected rows of [T, V] logits (CPU): argument
// checks, then the vector kernels (vocab_logprob_simd.h, built per instruction set in
// simd.cpp) over the rows, spread over torch's threads.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "simd.h"

namespace realhf {

namespace {

void check_logits(const torch::Tensor& logits, const torch::Tensor& rows, const char* fn) {
  TORCH_CHECK(float_or_bf16_cpu(logits) && logits.dim() == 2 && logits.stride(1) == 1,
              fn, ": logits must be a float32 or bfloat16 CPU tensor [T, V] with its last dim "
              "contiguous");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.dim() == 1 && rows.is_contiguous(),
              fn, ": rows must be a contiguous int64 [N] tensor");
  if (rows.numel()) {
    const int64_t lo = rows.min().item<int64_t>(), hi = rows.max().item<int64_t>();
    TORCH_CHECK_INDEX(lo >= 0 && hi < logits.size(0), fn, ": rows must lie in [0, ",
                      logits.size(0), "), got ", lo, "..", hi);
  }
}

void check_vector(const torch::Tensor& t, int64_t n, c10::ScalarType dt, const char* name,
                  const char* fn) {
  TORCH_CHECK(t.scalar_type() == dt && t.dim() == 1 && t.numel() == n && t.is_contiguous(), fn,
              ": ", name, " must be a contiguous [N] tensor of ", c10::toString(dt));
}

int64_t grain(int64_t V) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(V, 1)); }

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> row_logsumexp_cpu(const torch::Tensor& logits,
                                                           const torch::Tensor& rows,
                                                           double temperature,
                                                           const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  check_logits(logits, rows, "row_logsumexp");
  TORCH_CHECK_VALUE(temperature > 0, "row_logsumexp: temperature must be > 0");
  const int64_t N = rows.numel(), V = logits.size(1), xs = logits.stride(0);
  auto m = torch::empty({N}, logits.options().dtype(torch::kFloat32));
  auto s = torch::empty_like(m);
  const char* x = static_cast<const char*>(logits.data_ptr());
  const int64_t* r = rows.data_ptr<int64_t>();
  float* mp = m.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, N, grain(V), [&](int64_t i0, int64_t i1) {
    kernels.row_logsumexp(x, xs, V, r, i0, i1, t, mp, sp, bf16);
  });
  return {m, s};
}

void row_softmax_grad_cpu(const torch::Tensor& logits, const torch::Tensor& rows,
                          const torch::Tensor& lse, const torch::Tensor& coef,
                          const torch::Tensor& label, const torch::Tensor& label_add,
                          double temperature, torch::Tensor grad, const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  const char* fn = "row_softmax_grad";
  check_logits(logits, rows, fn);
  TORCH_CHECK_VALUE(temperature > 0, fn, ": temperature must be > 0");
  const int64_t N = rows.numel(), V = logits.size(1);
  check_vector(lse, N, torch::kFloat32, "lse", fn);
  check_vector(coef, N, torch::kFloat32, "coef", fn);
  check_vector(label_add, N, torch::kFloat32, "label_add", fn);
  check_vector(label, N, torch::kInt64, "label", fn);
  TORCH_CHECK(grad.scalar_type() == logits.scalar_type() && grad.sizes() == logits.sizes() &&
                  grad.stride(1) == 1,
              fn, ": grad must be shaped like logits, of its dtype, last dim contiguous");
  if (N) {
    const int64_t lo = label.min().item<int64_t>(), hi = label.max().item<int64_t>();
    TORCH_CHECK_INDEX(lo >= 0 && hi < V, fn, ": labels must lie in [0, ", V, "), got ", lo,
                      "..", hi);
  }
  const char* x = static_cast<const char*>(logits.data_ptr());
  char* g = static_cast<char*>(grad.data_ptr());
  const int64_t* r = rows.data_ptr<int64_t>();
  const float t = static_cast<float>(temperature);
  const bool bf16 = logits.scalar_type() == torch::kBFloat16;
  at::parallel_for(0, N, grain(V), [&](int64_t i0, int64_t i1) {
    kernels.row_softmax_grad(x, logits.stride(0), V, r, i0, i1, t, lse.data_ptr<float>(),
                             coef.data_ptr<float>(), label.data_ptr<int64_t>(),
                             label_add.data_ptr<float>(), g, grad.stride(0), bf16);
  });
}

}  // namespace realhf
