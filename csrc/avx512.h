// Shared pieces of realhf's AVX-512 CPU kernels (decode_attention.cpp, norm_rope.cpp).
//
// Functions carry target("avx512f,...") so the files build with the default flags; Python
// calls them only where the CPU has AVX-512 (avx512_supported(), in norm_rope.cpp). All here is
// inline and file-local to each kernel file.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define REALHF_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

namespace realhf {
namespace avx512 {

// 16 lanes of a float32 or bfloat16 row as float32 (a bfloat16 is a float32's top half).
template <bool BF16>
AVX512 inline __m512 load16(const void* p) {
  if constexpr (BF16) {
    __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p));
  }
}

// The first n <= 16 lanes of a row, the others 0.
template <bool BF16>
AVX512 inline __m512 load_n(const void* p, int n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (BF16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_maskz_loadu_ps(m, p);
  }
}

// float32 -> bfloat16 rounded to nearest even, NaN kept a (quiet) NaN: torch's rounding.
AVX512 inline __m256i to_bf16(__m512 x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// Round to the storage dtype and back: x as the dtype would hold it. For float32 that is x
// itself, held in a register (the empty asm) so that the compiler cannot fuse the product
// that made it into a following add (GCC contracts intrinsics into FMAs by default; torch's
// separate ops round each product).
template <bool BF16>
AVX512 inline __m512 round_to(__m512 x) {
  if constexpr (BF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
  } else {
    asm("" : "+v"(x));
    return x;
  }
}

// Store the first n <= 16 lanes in the storage dtype.
template <bool BF16>
AVX512 inline void store_n(void* p, __m512 x, int n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (BF16) {
    _mm256_mask_storeu_epi16(p, m, to_bf16(x));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p), m, x);
  }
}

}  // namespace avx512
}  // namespace realhf

#endif
