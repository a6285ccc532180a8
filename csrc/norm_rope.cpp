// RMSNorm and rotary embedding for inference (the generation engine), AVX-512 (CPU).
//
// At decode sizes (16-256 rows) each of these is 4-8 separate torch ops whose dispatch costs
// more than their arithmetic: RMSNorm over 64 rows of 256 took 22 us, rotating q and k of 64
// tokens 25 us, on the Xeon VM, one thread. Here each is one pass over its rows. They are
// used under torch.inference_mode() only (see realhf.impl.model.modules.norm / rotary), so
// training keeps torch's ops and autograd.
//
// Rounding follows the torch expressions they replace:
//  - RoPE, `x * cos + roll(x, D/2) * sin`: each product and the sum rounded to x's dtype
//    (float32 products are not fused into an FMA), so the result is torch's bit for bit;
//  - RMSNorm, `weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)` with h = x in float32: the
//    same roundings, but the sum of squares runs in another order than torch's reduction,
//    so the reciprocal RMS may differ in its last bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx512.h"
#include "kernels.h"

namespace realhf {

#ifdef REALHF_X86

namespace {

using avx512::load16;
using avx512::load_n;
using avx512::round_to;
using avx512::store_n;

template <bool BF16>
AVX512 void rms_rows(const char* x, const char* w, char* out, int64_t rows, int64_t D,
                     float eps) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const int64_t full = D / 16 * 16;
  const int rest = static_cast<int>(D - full);
  for (int64_t r = 0; r < rows; ++r) {
    const char* xr = x + r * D * elem;
    char* orow = out + r * D * elem;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16) {
      __m512 h = load16<BF16>(xr + i * elem);
      acc = _mm512_fmadd_ps(h, h, acc);
    }
    if (rest) {
      __m512 h = load_n<BF16>(xr + full * elem, rest);
      acc = _mm512_fmadd_ps(h, h, acc);
    }
    const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(D) + eps);
    const __m512 rs = _mm512_set1_ps(rstd);
    for (int64_t i = 0; i < D; i += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, D - i));
      __m512 h = n == 16 ? load16<BF16>(xr + i * elem) : load_n<BF16>(xr + i * elem, n);
      __m512 wv = n == 16 ? load16<BF16>(w + i * elem) : load_n<BF16>(w + i * elem, n);
      __m512 y = _mm512_mul_ps(wv, round_to<BF16>(_mm512_mul_ps(h, rs)));
      store_n<BF16>(orow + i * elem, y, n);
    }
  }
}

// len <= 16 lanes of one rotated row from position a: x[a..] * cos[a..] + x[b..] * sin[a..],
// each product and the sum rounded to the dtype.
template <bool BF16>
AVX512 inline void rope_part(const char* xr, const char* c, const char* s, char* orow, int64_t a,
                             int64_t b, int len) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  __m512 p = round_to<BF16>(_mm512_mul_ps(load_n<BF16>(xr + a * elem, len),
                                          load_n<BF16>(c + a * elem, len)));
  __m512 q = round_to<BF16>(_mm512_mul_ps(load_n<BF16>(xr + b * elem, len),
                                          load_n<BF16>(s + a * elem, len)));
  store_n<BF16>(orow + a * elem, _mm512_add_ps(p, q), len);
}

template <bool BF16>
AVX512 void rope_rows(const char* x, int64_t sT, int64_t sH, const char* cos, const char* sin,
                      int64_t sC, char* out, int64_t t0, int64_t t1, int64_t H, int64_t D) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const int64_t half = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const char* c = cos + t * sC * elem;
    const char* s = sin + t * sC * elem;
    for (int64_t h = 0; h < H; ++h) {
      const char* xr = x + (t * sT + h * sH) * elem;
      char* orow = out + (t * H + h) * D * elem;
      for (int64_t i = 0; i < D; i += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, D - i));
        // roll(x, D/2)[i] = x[(i + D/2) mod D]. A block of 16 lanes that straddles the
        // half (D/2 not a multiple of 16) is done in two parts.
        if (i >= half) {
          rope_part<BF16>(xr, c, s, orow, i, i - half, n);
        } else {
          const int m = static_cast<int>(std::min<int64_t>(n, half - i));
          rope_part<BF16>(xr, c, s, orow, i, i + half, m);
          if (m < n) rope_part<BF16>(xr, c, s, orow, i + m, i + m - half, n - m);
        }
      }
    }
  }
}

}  // namespace

bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

#else  // not x86-64 with GCC/clang

bool avx512_supported() { return false; }

#endif

torch::Tensor rms_norm_cpu(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(avx512_supported(), "rms_norm: this CPU has no AVX-512");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && x.is_contiguous() &&
                  x.dim() >= 1 && x.device().is_cpu(),
              "rms_norm: x must be a contiguous float32 or bfloat16 CPU tensor");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == dt && weight.is_contiguous() && weight.numel() == D,
              "rms_norm: weight must be a contiguous [D] tensor of x's dtype");
  auto out = torch::empty_like(x);
#ifdef REALHF_X86
  const int64_t rows = D ? x.numel() / D : 0;
  const int64_t elem = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(weight.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
                     const int64_t off = r0 * D * elem;
                     if (dt == torch::kBFloat16)
                       rms_rows<true>(xp + off, wp, op + off, r1 - r0, D, e);
                     else
                       rms_rows<false>(xp + off, wp, op + off, r1 - r0, D, e);
                   });
#endif
  return out;
}

torch::Tensor rope_cpu(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(avx512_supported(), "rope: this CPU has no AVX-512");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && x.dim() == 3 &&
                  x.stride(2) == 1 && x.device().is_cpu(),
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
#ifdef REALHF_X86
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* cp = static_cast<const char*>(cos.data_ptr());
  const char* sp = static_cast<const char*>(sin.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t sT = x.stride(0), sH = x.stride(1), sC = cos.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * D, 1)),
                   [&](int64_t t0, int64_t t1) {
                     if (dt == torch::kBFloat16)
                       rope_rows<true>(xp, sT, sH, cp, sp, sC, op, t0, t1, H, D);
                     else
                       rope_rows<false>(xp, sT, sH, cp, sp, sC, op, t0, t1, H, D);
                   });
#endif
  return out;
}

}  // namespace realhf
