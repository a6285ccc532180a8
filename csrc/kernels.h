// Declarations of realhf's CPU kernels (bound to Python in bindings.cpp).
// Semantics are documented in realhf/impl/kernels.py, next to the pure-PyTorch
// references the tests compare them against.
#pragma once

#include <torch/extension.h>

#include <map>
#include <string>
#include <tuple>

namespace realhf {

// Packed GAE. rewards[T], values[T+B], cu_seqlens[B+1] (int32/int64), bootstrap[B] bool.
std::tuple<torch::Tensor, torch::Tensor> gae_packed_cpu(const torch::Tensor& rewards,
                                                        const torch::Tensor& values,
                                                        const torch::Tensor& cu_seqlens,
                                                        const torch::Tensor& bootstrap,
                                                        double gamma, double lam);

// out = concat(src[s:e] for (s, e) in intervals); intervals is int64 [N, 2] on CPU.
torch::Tensor slice_intervals_cpu(const torch::Tensor& src, const torch::Tensor& intervals,
                                  c10::optional<torch::Tensor> out);

// dst[s:e] = consecutive pieces of src, in place; returns dst.
torch::Tensor set_intervals_cpu(const torch::Tensor& src, torch::Tensor dst,
                                const torch::Tensor& intervals);

// Fuse (s, e) with the previous interval when prev.e == s; single pass, order kept.
torch::Tensor merge_intervals(const torch::Tensor& intervals);

// The kernels below run on the CPU's vector units (simd.h): `isa` names the build to run,
// "avx512" or "avx2", and "" the widest this CPU runs; each throws where the CPU runs
// neither (simd_isa() says which it runs).

// The widest build of the vector kernels this CPU runs: "avx512", "avx2" or "".
std::string simd_isa();

// Whether t is a CPU tensor of a dtype the vector kernels read: float32 or bfloat16.
inline bool float_or_bf16_cpu(const torch::Tensor& t) {
  const auto dt = t.scalar_type();
  return (dt == torch::kFloat32 || dt == torch::kBFloat16) && t.device().is_cpu();
}

// Decode attention over the paged KV cache (see decode_attention_simd.h and
// realhf.impl.model.gen.cache_attention). q, out [B, n_kv, g, D] float32; k_new, v_new
// [B, n_kv, D] and kc, vc [N, n_kv, D] float32 or bfloat16; table [B, width] and lens [B]
// int64. Stores k_new / v_new at position lens - 1, then attends.
void decode_attention_cpu(const torch::Tensor& q, const torch::Tensor& k_new,
                          const torch::Tensor& v_new, torch::Tensor kc, torch::Tensor vc,
                          const torch::Tensor& table, const torch::Tensor& lens, int64_t page,
                          int64_t window, double scale, torch::Tensor out,
                          const std::string& isa);

// Whether decode_attention_cpu takes this head size (a multiple of 16 up to 128, or 256).
bool decode_attention_head_size_ok(int64_t d);

// Inference-only RMSNorm over the last dim of a contiguous float32 or bfloat16 x [..., D]
// with weight [D] of x's dtype: weight * round(x * rsqrt(mean(x^2) + eps)), statistics in
// float32, rounded to x's dtype where realhf.impl.model.modules.norm rounds.
torch::Tensor rms_norm_cpu(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                           const std::string& isa);

// Inference-only rotary embedding: x [T, H, D] (last dim contiguous, any other strides),
// cos and signed sin [T, 1, D] of x's dtype -> contiguous x * cos + roll(x, D / 2) * sin,
// rounded as torch rounds each of the three ops (bit for bit).
torch::Tensor rope_cpu(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       const std::string& isa);

// Log-softmax over the vocabulary of selected rows of logits [T, V] (float32 or bfloat16,
// last dim contiguous; rows int64 [N]), see vocab_logprob_simd.h and
// realhf.impl.model.modules.vocab_chunked: (m, s) float32 [N] with m the max of
// logits[rows] / t and s the sum of exp(logits[rows] / t - m) (log-sum-exp = m + log s).
std::tuple<torch::Tensor, torch::Tensor> row_logsumexp_cpu(const torch::Tensor& logits,
                                                           const torch::Tensor& rows,
                                                           double temperature,
                                                           const std::string& isa);

// Rows `rows` of grad (shaped like logits, its dtype) = coef * softmax(logits[rows] / t)
// computed from lse [N], plus label_add at column label (int64 [N]); other rows untouched.
void row_softmax_grad_cpu(const torch::Tensor& logits, const torch::Tensor& rows,
                          const torch::Tensor& lse, const torch::Tensor& coef,
                          const torch::Tensor& label, const torch::Tensor& label_add,
                          double temperature, torch::Tensor grad, const std::string& isa);

// One AdamW step, in place, of float32 master weights `param` and moments `exp_avg`,
// `exp_avg_sq` (contiguous, one size) with `grad` (float32 or bfloat16, same size) scaled by
// grad_coef; `step` is the step count after this step.  The new weights also go, rounded, to
// `low` (bfloat16, same size) unless it is None.  See adamw_simd.h.
void adamw_step_cpu(torch::Tensor param, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                    const torch::Tensor& grad, const c10::optional<torch::Tensor>& low,
                    double lr, double beta1, double beta2, double weight_decay, double eps,
                    double step, double grad_coef, const std::string& isa);

// Sum of squares of a contiguous float32 or bfloat16 CPU tensor, in double: spans of 64k
// elements summed in float32 (the same for a bf16 tensor and its float32 conversion), the
// spans' sums added in order (the same whatever the thread count).
double sum_squares_cpu(const torch::Tensor& x, const std::string& isa);

// silu(gate) * up, and its gradients (d_gate, d_up) from the output's gradient: contiguous
// float32 or bfloat16 CPU tensors of one shape and dtype.  The forward also takes [T, F]
// gate and up with contiguous rows at any row stride (the halves of a fused gate/up
// product), and returns a contiguous [T, F].  See gated_act_simd.h.
torch::Tensor silu_mul_cpu(const torch::Tensor& gate, const torch::Tensor& up,
                           const std::string& isa);
std::tuple<torch::Tensor, torch::Tensor> silu_mul_backward_cpu(const torch::Tensor& gate,
                                                               const torch::Tensor& up,
                                                               const torch::Tensor& grad_out,
                                                               const std::string& isa);

// y [M, n_out] = x [M, K] @ W.T + bias for the few rows of a decode step, float32, with W
// packed as [ceil(n_out / 16), K, 16] (blocks of 16 output rows of W, k-major, the last block
// padded with zeros) and bias (if any) padded to ceil(n_out / 16) * 16.  See
// decode_linear_simd.h and realhf.impl.model.nn.packed_linear.
torch::Tensor decode_linear_cpu(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias, int64_t n_out,
                                const std::string& isa);

// A CPU allocator for tensors of at least min_bytes that keeps the memory they free for the
// next ones (csrc/tensor_pool.cpp): installed once per process as torch's CPU allocator,
// over reserve_bytes of reserved addresses.  Returns false if one is installed already.
bool tensor_pool_install(int64_t reserve_bytes, int64_t min_bytes);
// Give the pages of its free blocks back to the system; returns the bytes given back.
int64_t tensor_pool_trim();
// live_bytes, live_blocks, touched_bytes, free_blocks, reserved_bytes, min_bytes,
// fallbacks (tensors the range could not hold); empty where none is installed.
std::map<std::string, int64_t> tensor_pool_stats();

}  // namespace realhf
