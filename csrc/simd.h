// realhf's vector CPU kernels (the generation engine's decode attention, RMSNorm and RoPE;
// training's log-softmax over a large vocabulary, its gated MLP activation, its AdamW step
// on master weights and its gradient norm), built once per instruction set.
//
// The kernels are written once (decode_attention_simd.h, norm_rope_simd.h,
// vocab_logprob_simd.h, adamw_simd.h, gated_act_simd.h) against the small
// vector layer of simd_vec.h. simd.cpp compiles them twice, for AVX-512 and for AVX2, each in
// a namespace of that name under `#pragma GCC target`; the torch-facing
// functions (decode_attention.cpp, norm_rope.cpp) check their arguments and call the widest
// build this CPU runs (or the one a caller names, so that tests run both where they can).
// Built with GCC on x86-64; other compilers and CPUs get no vector kernels and the engine
// uses its numba kernel and torch's ops instead.
#pragma once

#include <cstdint>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define REALHF_SIMD 1
#endif

namespace realhf {

// The instruction sets, widest last.
enum class Isa { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest this CPU runs: AVX-512 (F, BW, DQ, VL), else AVX2 with FMA, else none
// (detected once).
Isa cpu_isa();

// "avx512", "avx2" or "" (none) for an Isa, and back ("" is the CPU's widest). Throws (a
// Python ValueError) on an unknown name or one this CPU does not run.
const char* isa_name(Isa isa);
Isa isa_for(const std::string& name);

// Arguments of the decode-attention kernel (see decode_attention_simd.h).
struct DecodeArgs {
  const float* q;        // [B, n_kv, g, D]
  const char* k_new;     // [B, n_kv, D], cache dtype
  const char* v_new;
  char* kc;              // [N, n_kv, D]
  char* vc;
  const int64_t* table;  // [B, width]
  const int64_t* lens;   // [B]
  float* out;            // [B, n_kv, g, D]
  int64_t B, n_kv, g, D, width, page, window;
  float scale;
  bool bf16;             // caches (and k_new, v_new) bfloat16, else float32
};

// Scalars of an AdamW step (see adamw_simd.h): float32, from the caller's doubles.
struct AdamWArgs {
  float grad_coef;  // the gradient's scale (the clipping coefficient, else 1)
  float decay;      // 1 - lr * weight_decay
  float beta1, beta2, eps;
  float step_size;  // lr / (1 - beta1^t)
  float bc2_sqrt;   // sqrt(1 - beta2^t)
};

// The kernels of one build. Each runs on the calling thread; the torch-facing functions
// spread work over threads.
struct SimdKernels {
  // decode attention for sequences [b0, b1)
  void (*decode_attention)(const DecodeArgs& a, int64_t b0, int64_t b1);
  // RMSNorm of `rows` rows of D (float32, or bfloat16 when bf16)
  void (*rms_norm)(const char* x, const char* w, char* out, int64_t rows, int64_t D, float eps,
                   bool bf16);
  // RoPE of tokens [t0, t1) of x [T, H, D] (strides sT, sH; last dim contiguous) with
  // cos, sin [T, 1, D] (token stride sC), into a contiguous out [T, H, D]
  void (*rope)(const char* x, int64_t sT, int64_t sH, const char* cos, const char* sin,
               int64_t sC, char* out, int64_t t0, int64_t t1, int64_t H, int64_t D, bool bf16);
  // per selected row n in [i0, i1) of x [T, V] (row stride xs; float32, or bfloat16 when
  // bf16), row rows[n]: m[n] = max of x / t, s[n] = sum of exp(x / t - m[n])
  void (*row_logsumexp)(const char* x, int64_t xs, int64_t V, const int64_t* rows, int64_t i0,
                        int64_t i1, float t, float* m, float* s, bool bf16);
  // the same rows of g (row stride gs, x's dtype) = coef[n] * exp(x / t - lse[n]), plus
  // label_add[n] at column label[n]
  void (*row_softmax_grad)(const char* x, int64_t xs, int64_t V, const int64_t* rows,
                           int64_t i0, int64_t i1, float t, const float* lse,
                           const float* coef, const int64_t* label, const float* label_add,
                           char* g, int64_t gs, bool bf16);
  // AdamW of elements [i0, i1): master weights p, moments m and v (float32), gradient g
  // (bfloat16 when g_bf16, else float32); the new weights also into low (bfloat16) unless
  // it is null
  void (*adamw)(float* p, float* m, float* v, const char* g, bool g_bf16, uint16_t* low,
                int64_t i0, int64_t i1, const AdamWArgs& a);
  // sum of squares of elements [i0, i1) of x (bfloat16 when bf16, else float32)
  double (*sum_squares)(const char* x, bool bf16, int64_t i0, int64_t i1);
  // elements [i0, i1) of out = silu(g) * u, and of the gradients dg and du from dy (all
  // float32, or bfloat16 when bf16)
  void (*silu_mul)(const char* g, const char* u, char* out, int64_t i0, int64_t i1, bool bf16);
  void (*silu_mul_grad)(const char* g, const char* u, const char* dy, char* dg, char* du,
                        int64_t i0, int64_t i1, bool bf16);
  // blocks [nb0, nb1) of 16 columns of y [M, N] = x @ W.T + bias (float32), from x
  // transposed xt [K, M], W packed as [ceil(N / 16), K, 16] and the padded bias (or null)
  void (*decode_linear)(const float* xt, int64_t M, const float* wp, const float* bias,
                        float* y, int64_t N, int64_t K, int64_t nb0, int64_t nb1);
};

// The build for `isa` (the CPU must run it: see isa_for).
const SimdKernels& simd_kernels(Isa isa);

}  // namespace realhf
