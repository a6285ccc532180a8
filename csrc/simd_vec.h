// The vector layer of realhf's CPU kernels: one float32 vector type `F` of `W` lanes and the
// operations the kernels use, for the instruction set simd.cpp targets when it includes
// this file (REALHF_SIMD_AVX512 or REALHF_SIMD_AVX2 defined), in namespace
// realhf::REALHF_SIMD_NS (avx512 or avx2). No include guard: it is included once per
// instruction set.
//
// Rows in memory are float32 or bfloat16 (a bfloat16 is a float32's top half): the row
// functions (load, store and their _n and _upto forms, round_to) take it as `BF16`.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace realhf {
namespace REALHF_SIMD_NS {

#if defined(REALHF_SIMD_AVX512)

using F = __m512;
constexpr int W = 16;      // float32 lanes
constexpr int kRegs = 32;  // vector registers

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float x) { return _mm512_set1_ps(x); }
inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
inline void storef(float* p, F x) { _mm512_storeu_ps(p, x); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float reduce_add(F x) { return _mm512_reduce_add_ps(x); }
inline float reduce_max(F x) { return _mm512_reduce_max_ps(x); }
// x, with 0 in the lanes where `where` is -inf
inline F zero_where_neg_inf(F x, F where) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(where, set1(-INFINITY), _CMP_EQ_OQ), x, zero());
}

inline F widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 -> bfloat16 rounded to nearest even, NaN kept a (quiet) NaN: torch's rounding.
inline __m256i to_bf16(F x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// W lanes of a row as float32.
template <bool BF16>
inline F load(const void* p) {
  if constexpr (BF16) return widen_bf16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  else return _mm512_loadu_ps(static_cast<const float*>(p));
}

// Store W lanes in the storage type.
template <bool BF16>
inline void store(void* p, F x) {
  if constexpr (BF16) _mm256_storeu_si256(static_cast<__m256i*>(p), to_bf16(x));
  else _mm512_storeu_ps(static_cast<float*>(p), x);
}

// The first n <= W lanes of a row, the others 0.
template <bool BF16>
inline F load_n(const void* p, int n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (BF16) return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
  else return _mm512_maskz_loadu_ps(m, p);
}

// Store the first n <= W lanes in the storage type.
template <bool BF16>
inline void store_n(void* p, F x, int n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (BF16) _mm256_mask_storeu_epi16(p, m, to_bf16(x));
  else _mm512_mask_storeu_ps(static_cast<float*>(p), m, x);
}

// Round to the storage type and back: x as the type would hold it. For float32 that is x
// itself, held in a register (the empty asm) so that the compiler cannot fuse the product
// that made it into a following add (GCC contracts intrinsics into FMAs by default; torch's
// separate ops round each product).
template <bool BF16>
inline F round_to(F x) {
  if constexpr (BF16) {
    return widen_bf16(to_bf16(x));
  } else {
    asm("" : "+v"(x));
    return x;
  }
}

// 2^k * x for whole-number k in [-126, 0] (the exp below)
inline F scale_pow2(F x, F k) { return _mm512_scalef_ps(x, k); }
inline F floor(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// |x|, and the lanes of a where x < 0, of b elsewhere
inline F abs(F x) { return _mm512_abs_ps(x); }
inline F where_neg(F x, F a, F b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_LT_OQ), b, a);
}

// One vector whose lane i is the sum of the lanes of v[i], i < 16 (v is overwritten).
// Four levels, each adding two halves of pairs: 256-bit halves, 128-bit quarters, then
// pairs and single lanes within each 128-bit quarter. The lanes come out permuted; the
// final permute puts source i in lane i.
inline F sum_lanes(F* v) {
  for (int i = 0; i < 8; ++i) {  // [a | b] halves: lanes 0-7 partial sums of a, 8-15 of b
    F a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarters: one source per 128-bit quarter, 4 partials
    F a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // two sources per quarter, 2 partials each
    F a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  F s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  // Source i's sum is in lane kLane[i] of s (read off the shuffles above).
  static const int32_t kLane[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  return _mm512_permutexvar_ps(_mm512_loadu_si512(kLane), s);
}

#elif defined(REALHF_SIMD_AVX2)

using F = __m256;
constexpr int W = 8;       // float32 lanes
constexpr int kRegs = 16;  // vector registers

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float x) { return _mm256_set1_ps(x); }
inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
inline void storef(float* p, F x) { _mm256_storeu_ps(p, x); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }   // a * b + c
inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b
inline float reduce_add(F x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(F x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// x, with 0 in the lanes where `where` is -inf
inline F zero_where_neg_inf(F x, F where) {
  return _mm256_blendv_ps(x, zero(), _mm256_cmp_ps(where, set1(-INFINITY), _CMP_EQ_OQ));
}

inline F widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// float32 -> bfloat16 rounded to nearest even, NaN kept a (quiet) NaN: torch's rounding.
inline __m128i to_bf16(F x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  // 8 values < 2^16 in 32-bit lanes -> 8 16-bit lanes (the pack saturates, nothing to clip)
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// W lanes of a row as float32.
template <bool BF16>
inline F load(const void* p) {
  if constexpr (BF16) return widen_bf16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  else return _mm256_loadu_ps(static_cast<const float*>(p));
}

// Store W lanes in the storage type.
template <bool BF16>
inline void store(void* p, F x) {
  if constexpr (BF16) _mm_storeu_si128(static_cast<__m128i*>(p), to_bf16(x));
  else _mm256_storeu_ps(static_cast<float*>(p), x);
}

// The first n <= W lanes of a row, the others 0 (AVX2 has no 16-bit masked loads: the
// lanes go through a buffer; load_upto takes the plain load for whole vectors).
template <bool BF16>
inline F load_n(const void* p, int n) {
  alignas(32) unsigned char buf[W * 4] = {};
  std::memcpy(buf, p, n * (BF16 ? 2 : 4));
  return load<BF16>(buf);
}

// Store the first n <= W lanes in the storage type.
template <bool BF16>
inline void store_n(void* p, F x, int n) {
  alignas(32) unsigned char buf[W * 4];
  if constexpr (BF16) _mm_store_si128(reinterpret_cast<__m128i*>(buf), to_bf16(x));
  else _mm256_store_ps(reinterpret_cast<float*>(buf), x);
  std::memcpy(p, buf, n * (BF16 ? 2 : 4));
}

// As avx512::round_to: x as the storage type would hold it, a float32 product kept out of
// a following add.
template <bool BF16>
inline F round_to(F x) {
  if constexpr (BF16) {
    return widen_bf16(to_bf16(x));
  } else {
    asm("" : "+x"(x));
    return x;
  }
}

// 2^k * x for whole-number k in [-126, 0] (the exp below): k's bits as a float's exponent.
inline F scale_pow2(F x, F k) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(e));
}
inline F floor(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline F abs(F x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline F where_neg(F x, F a, F b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, zero(), _CMP_LT_OQ)); }

// One vector whose lane i is the sum of the lanes of v[i], i < 8: two levels of pairwise
// horizontal adds leave the sums of each 128-bit half of v[0..3] in one vector and of
// v[4..7] in another; adding their halves crosswise gives the sums in order.
inline F sum_lanes(F* v) {
  F ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  F cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

#endif

// Whole vectors with the plain load and store, partial ones (n < W) masked.
template <bool BF16>
inline F load_upto(const void* p, int n) {
  return n == W ? load<BF16>(p) : load_n<BF16>(p, n);
}
template <bool BF16>
inline void store_upto(void* p, F x, int n) {
  if (n == W) store<BF16>(p, x);
  else store_n<BF16>(p, x, n);
}

// exp(x) for x <= 0 (Cephes' expf polynomial, as the numba kernel's _exp_split; relative
// error ~1e-7); below -87 the result is that of -87.
inline F exp_neg(F x) {
  x = max(x, set1(-87.0f));
  F k = floor(fmadd(x, set1(1.44269504f), set1(0.5f)));
  F r = fnmadd(k, set1(0.693359375f), x);
  r = fnmadd(k, set1(-2.12194440e-4f), r);
  F p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  F e = add(fmadd(p, mul(r, r), r), set1(1.0f));
  return scale_pow2(e, k);
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
