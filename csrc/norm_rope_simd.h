// RMSNorm and rotary embedding for inference (the generation engine), for one instruction
// set (included by simd.cpp once per instruction set, after simd_vec.h).
//
// At decode sizes (16-256 rows) each of these is 4-8 separate torch ops whose dispatch costs
// more than their arithmetic: RMSNorm over 64 rows of 256 took 22 us, rotating q and k of 64
// tokens 25 us, on the Xeon VM, one thread (54 and 49 us on a Zen 1 EPYC; these kernels'
// AVX2 build there: 10 and 21 us). Here each is one pass over its rows. They are
// used under torch.inference_mode() only (see realhf.impl.model.modules.norm / rotary), so
// training keeps torch's ops and autograd.
//
// Rounding follows the torch expressions they replace:
//  - RoPE, `x * cos + roll(x, D/2) * sin`: each product and the sum rounded to x's dtype
//    (float32 products are not fused into an FMA), so the result is torch's bit for bit;
//  - RMSNorm, `weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)` with h = x in float32: the
//    same roundings, but the sum of squares runs in another order than torch's reduction,
//    so the reciprocal RMS may differ in its last bit.

namespace realhf {
namespace REALHF_SIMD_NS {
namespace {

template <bool BF16>
void rms_rows(const char* x, const char* w, char* out, int64_t rows, int64_t D, float eps) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const int64_t full = D / W * W;
  const int rest = static_cast<int>(D - full);
  for (int64_t r = 0; r < rows; ++r) {
    const char* xr = x + r * D * elem;
    char* orow = out + r * D * elem;
    F acc = zero();
    for (int64_t i = 0; i < full; i += W) {
      F h = load<BF16>(xr + i * elem);
      acc = fmadd(h, h, acc);
    }
    if (rest) {
      F h = load_n<BF16>(xr + full * elem, rest);
      acc = fmadd(h, h, acc);
    }
    const float rstd = 1.0f / std::sqrt(reduce_add(acc) / static_cast<float>(D) + eps);
    const F rs = set1(rstd);
    for (int64_t i = 0; i < D; i += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, D - i));
      F h = load_upto<BF16>(xr + i * elem, n);
      F wv = load_upto<BF16>(w + i * elem, n);
      store_upto<BF16>(orow + i * elem, mul(wv, round_to<BF16>(mul(h, rs))), n);
    }
  }
}

// len <= W lanes of one rotated row from position a: x[a..] * cos[a..] + x[b..] * sin[a..],
// each product and the sum rounded to the dtype.
template <bool BF16>
inline void rope_part(const char* xr, const char* c, const char* s, char* orow, int64_t a,
                      int64_t b, int len) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  F p = round_to<BF16>(mul(load_upto<BF16>(xr + a * elem, len), load_upto<BF16>(c + a * elem, len)));
  F q = round_to<BF16>(mul(load_upto<BF16>(xr + b * elem, len), load_upto<BF16>(s + a * elem, len)));
  store_upto<BF16>(orow + a * elem, add(p, q), len);
}

template <bool BF16>
void rope_rows(const char* x, int64_t sT, int64_t sH, const char* cos, const char* sin,
               int64_t sC, char* out, int64_t t0, int64_t t1, int64_t H, int64_t D) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const int64_t half = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const char* c = cos + t * sC * elem;
    const char* s = sin + t * sC * elem;
    for (int64_t h = 0; h < H; ++h) {
      const char* xr = x + (t * sT + h * sH) * elem;
      char* orow = out + (t * H + h) * D * elem;
      for (int64_t i = 0; i < D; i += W) {
        const int n = static_cast<int>(std::min<int64_t>(W, D - i));
        // roll(x, D/2)[i] = x[(i + D/2) mod D]. A block of W lanes that straddles the
        // half (D/2 not a multiple of W) is done in two parts.
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

void rms_norm(const char* x, const char* w, char* out, int64_t rows, int64_t D, float eps,
              bool bf16) {
  if (bf16) rms_rows<true>(x, w, out, rows, D, eps);
  else rms_rows<false>(x, w, out, rows, D, eps);
}

void rope(const char* x, int64_t sT, int64_t sH, const char* cos, const char* sin, int64_t sC,
          char* out, int64_t t0, int64_t t1, int64_t H, int64_t D, bool bf16) {
  if (bf16) rope_rows<true>(x, sT, sH, cos, sin, sC, out, t0, t1, H, D);
  else rope_rows<false>(x, sT, sH, cos, sin, sC, out, t0, t1, H, D);
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
