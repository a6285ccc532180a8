// Decode attention over the paged KV cache (CPU): argument checks, then the vector kernel
// (decode_attention_simd.h, built per instruction set in simd.cpp) over the sequences,
// spread over torch's threads.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "simd.h"

namespace realhf {

bool decode_attention_head_size_ok(int64_t d) {
#ifdef REALHF_SIMD
  return d == 256 || (d > 0 && d <= 128 && d % 16 == 0);
#else
  return false;
#endif
}

void decode_attention_cpu(const torch::Tensor& q, const torch::Tensor& k_new,
                          const torch::Tensor& v_new, torch::Tensor kc, torch::Tensor vc,
                          const torch::Tensor& table, const torch::Tensor& lens, int64_t page,
                          int64_t window, double scale, torch::Tensor out,
                          const std::string& isa) {
  const SimdKernels& kernels = simd_kernels(isa_for(isa));
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "decode_attention: q must be a contiguous float32 [B, n_kv, g, D] tensor");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 &&
                  out.is_contiguous(),
              "decode_attention: out must be a contiguous float32 tensor shaped like q");
  const int64_t B = q.size(0), n_kv = q.size(1), g = q.size(2), D = q.size(3);
  const auto dt = kc.scalar_type();
  TORCH_CHECK(float_or_bf16_cpu(kc),
              "decode_attention: caches must be float32 or bfloat16 CPU tensors");
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&k_new, &v_new, &kc, &vc}) {
    TORCH_CHECK(t->scalar_type() == dt && t->is_contiguous() && t->dim() == 3 &&
                    t->size(1) == n_kv && t->size(2) == D,
                "decode_attention: k_new, v_new [B, n_kv, D] and kc, vc [N, n_kv, D] must be "
                "contiguous, of the cache's dtype");
  }
  TORCH_CHECK(k_new.size(0) == B && v_new.size(0) == B, "decode_attention: k_new/v_new rows != B");
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 2 && table.size(0) == B &&
                  table.is_contiguous(),
              "decode_attention: table must be a contiguous int64 [B, width] tensor");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && lens.numel() == B && lens.is_contiguous(),
              "decode_attention: lens must be a contiguous int64 [B] tensor");
  TORCH_CHECK(decode_attention_head_size_ok(D), "decode_attention: head size ", D,
              " (a multiple of 16 up to 128, or 256)");
  const DecodeArgs a{q.data_ptr<float>(),
                    static_cast<const char*>(k_new.data_ptr()),
                    static_cast<const char*>(v_new.data_ptr()),
                    static_cast<char*>(kc.data_ptr()),
                    static_cast<char*>(vc.data_ptr()),
                    table.data_ptr<int64_t>(),
                    lens.data_ptr<int64_t>(),
                    out.data_ptr<float>(),
                    B, n_kv, g, D, table.size(1), page, window, static_cast<float>(scale),
                    dt == torch::kBFloat16};
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) { kernels.decode_attention(a, b0, b1); });
}

}  // namespace realhf
