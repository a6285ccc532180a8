// Decode attention over the paged KV cache, AVX-512 (CPU).
//
// The same contract as the numba kernel in realhf/impl/model/gen/cache_attention.py, which
// documents it and remains the path for CPUs without AVX-512: one query token per running
// sequence attends to the first lens[b] cached positions of its sequence, position t at
// pool row table[b][t / page] * page + t % page; the new token's key and value are stored
// at position lens[b] - 1 first. Caches are float32 or bfloat16 (widened to float32 as they
// are read); arithmetic is float32.
//
// Why a second kernel: at real model shapes (7 query heads per kv head) the numba build is
// bound by its arithmetic, not by reading the cache, because LLVM reduces every dot product
// horizontally on its own and keeps the output in memory across rows. Here
//  - scores are made 16 keys at a time: 16 dot-product vectors reduced together into one
//    vector of 16 scores (a transposing add tree), not 16 horizontal reductions;
//  - the weighted sum of values keeps up to 4 query heads' outputs in registers while the
//    values of every position stream past once per 4 heads;
//  - exp is a vector polynomial with _mm512_scalef_ps for the power of two.
// Python calls it only where the CPU has AVX-512 (avx512_supported(), in norm_rope.cpp).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512.h"
#include "kernels.h"

namespace realhf {

#ifdef REALHF_X86

namespace {

using avx512::load16;

// exp(x) for x <= 0 (Cephes' expf polynomial, as the numba kernel's _exp_split; relative
// error ~1e-7); below -87 the result is that of -87.
AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f),
                                                  _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e, k);
}

// One vector whose lane i is the sum of the lanes of v[i], for i < 16 (v is overwritten).
// Four levels, each adding two halves of pairs: 256-bit halves, 128-bit quarters, then
// pairs and single lanes within each 128-bit quarter. The lanes come out permuted; the
// final permute puts source i in lane i.
AVX512 inline __m512 sum16(__m512* v) {
  for (int i = 0; i < 8; ++i) {  // [a | b] halves: lanes 0-7 partial sums of a, 8-15 of b
    __m512 a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarters: one source per 128-bit quarter, 4 partials
    __m512 a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // two sources per quarter, 2 partials each
    __m512 a = v[2 * i], b = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  // Source i's sum is in lane kLane[i] of s (read off the shuffles above).
  static const int32_t kLane[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  return _mm512_permutexvar_ps(_mm512_loadu_si512(kLane), s);
}

AVX512 inline void prefetch_rows(const char* pool, int64_t row_bytes, int64_t start, int64_t end) {
  for (int64_t r = start; r < end; ++r)
    for (int64_t x = 0; x < row_bytes; x += 64) _mm_prefetch(pool + r * row_bytes + x, _MM_HINT_T0);
}

struct Args {
  const float* q;          // [B, n_kv, g, D]
  const char* k_new;       // [B, n_kv, D], cache dtype
  const char* v_new;
  char* kc;                // [N, n_kv, D]
  char* vc;
  const int64_t* table;    // [B, width]
  const int64_t* lens;     // [B]
  float* out;              // [B, n_kv, g, D]
  int64_t B, n_kv, g, width, page, window;
  float scale;
};

// The pool rows [start, end) sequence b reads on its page pg when it attends to [lo, hi).
inline void page_rows(const Args& a, int64_t b, int64_t pg, int64_t lo, int64_t hi,
                      int64_t* start, int64_t* end) {
  int64_t base = a.table[b * a.width + pg] * a.page;
  *start = base + std::max<int64_t>(lo - pg * a.page, 0);
  *end = base + std::min<int64_t>(hi - pg * a.page, a.page);
}

// The weighted sum of values for query heads [g0, g0 + NG) of kv head h, outputs in
// registers while every position's value row streams past.
template <int ND, bool BF16, int NG>
AVX512 void weighted_values(const Args& a, int64_t b, int64_t h, int64_t g0, int64_t lo,
                            int64_t hi, const float* sc, int64_t stride, float* out) {
  constexpr int64_t D = ND * 16;
  const int64_t elem = BF16 ? 2 : 4, row_bytes = a.n_kv * D * elem;
  __m512 acc[NG][ND];
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_setzero_ps();
  const int64_t first = lo / a.page, last = (hi - 1) / a.page;
  int64_t t = 0;
  for (int64_t pg = first; pg <= last; ++pg) {
    int64_t start, end;
    if (pg < last) {
      page_rows(a, b, pg + 1, lo, hi, &start, &end);
      prefetch_rows(a.vc, row_bytes, start, end);
    }
    page_rows(a, b, pg, lo, hi, &start, &end);
    for (int64_t r = start; r < end; ++r, ++t) {
      const char* vr = a.vc + r * row_bytes + h * D * elem;
      __m512 v[ND];
      for (int c = 0; c < ND; ++c) v[c] = load16<BF16>(vr + c * 16 * elem);
      for (int i = 0; i < NG; ++i) {
        __m512 p = _mm512_set1_ps(sc[(h * a.g + g0 + i) * stride + t]);
        for (int c = 0; c < ND; ++c) acc[i][c] = _mm512_fmadd_ps(p, v[c], acc[i][c]);
      }
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < ND; ++c)
      _mm512_storeu_ps(out + ((h * a.g + g0 + i) * D + c * 16), acc[i][c]);
}

// Scaled scores of every query head against nb <= 16 key rows (pool rows, all kv heads):
// sc[(h * g + gi) * stride + j] for j < nb.
template <int ND, bool BF16>
AVX512 void score_block(const Args& a, const char* const* rows, int nb, const float* qb,
                        float* sc, int64_t stride) {
  constexpr int64_t D = ND * 16;
  constexpr int64_t elem = BF16 ? 2 : 4;
  alignas(64) float wide[BF16 ? 16 * D : 1];  // a bfloat16 block widened once per kv head
  for (int64_t h = 0; h < a.n_kv; ++h) {
    const float* keys[16];
    for (int j = 0; j < nb; ++j) {
      const char* kr = rows[j] + h * D * elem;
      if constexpr (BF16) {
        for (int c = 0; c < ND; ++c) _mm512_store_ps(wide + j * D + c * 16, load16<true>(kr + c * 32));
        keys[j] = wide + j * D;
      } else {
        keys[j] = reinterpret_cast<const float*>(kr);
      }
    }
    for (int64_t gi = 0; gi < a.g; ++gi) {
      const float* qr = qb + (h * a.g + gi) * D;
      __m512 qv[ND];
      for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(qr + c * 16);
      __m512 dots[16];
      for (int j = 0; j < 16; ++j) {
        if (j < nb) {
          __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys[j]));
          for (int c = 1; c < ND; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys[j] + c * 16), s);
          dots[j] = s;
        } else {
          dots[j] = _mm512_setzero_ps();
        }
      }
      __m512 s = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(a.scale));
      _mm512_mask_storeu_ps(sc + (h * a.g + gi) * stride, (__mmask16)((1u << nb) - 1), s);
    }
  }
}

template <int ND, bool BF16>
AVX512 void decode_one(const Args& a, int64_t b, std::vector<float>& scratch) {
  constexpr int64_t D = ND * 16;
  const int64_t elem = BF16 ? 2 : 4, row_bytes = a.n_kv * D * elem;
  const int64_t n_q = a.n_kv * a.g;
  const int64_t hi = a.lens[b];
  {  // the new key and value, on a page of this sequence's own
    const int64_t r = a.table[b * a.width + (hi - 1) / a.page] * a.page + (hi - 1) % a.page;
    std::memcpy(a.kc + r * row_bytes, a.k_new + b * row_bytes, row_bytes);
    std::memcpy(a.vc + r * row_bytes, a.v_new + b * row_bytes, row_bytes);
  }
  const int64_t lo = (a.window > 0 && hi > a.window) ? hi - a.window : 0;
  const int64_t n = hi - lo, stride = (n + 15) / 16 * 16;
  if (static_cast<int64_t>(scratch.size()) < n_q * stride) scratch.resize(n_q * stride);
  float* sc = scratch.data();
  const float* qb = a.q + b * n_q * D;
  const int64_t first = lo / a.page, last = (hi - 1) / a.page;

  // Scores, 16 positions at a time (rows gathered across page ends into one block).
  const char* rows[16];
  int nb = 0;
  int64_t t0 = 0;
  for (int64_t pg = first; pg <= last; ++pg) {
    int64_t start, end;
    if (pg < last) {
      page_rows(a, b, pg + 1, lo, hi, &start, &end);
      prefetch_rows(a.kc, row_bytes, start, end);
    } else {
      page_rows(a, b, first, lo, hi, &start, &end);
      prefetch_rows(a.vc, row_bytes, start, end);
    }
    page_rows(a, b, pg, lo, hi, &start, &end);
    for (int64_t r = start; r < end; ++r) {
      rows[nb++] = a.kc + r * row_bytes;
      if (nb == 16) {
        score_block<ND, BF16>(a, rows, nb, qb, sc + t0, stride);
        t0 += nb;
        nb = 0;
      }
    }
  }
  if (nb) score_block<ND, BF16>(a, rows, nb, qb, sc + t0, stride);

  // Softmax of each query head's scores, less the row max (exp of raw scores overflows).
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n_q; ++j) {
    float* row = sc + j * stride;
    for (int64_t t = n; t < stride; ++t) row[t] = -INFINITY;  // the last block's tail
    __m512 m = neg_inf;
    for (int64_t t = 0; t < stride; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 den = _mm512_setzero_ps();
    for (int64_t t = 0; t < stride; t += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mx));
      e = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_loadu_ps(row + t), neg_inf, _CMP_EQ_OQ),
                               e, _mm512_setzero_ps());
      _mm512_storeu_ps(row + t, e);
      den = _mm512_add_ps(den, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(den));
    for (int64_t t = 0; t < stride; t += 16)
      _mm512_storeu_ps(row + t, _mm512_mul_ps(_mm512_loadu_ps(row + t), inv));
  }

  // Values: NG query heads per pass over the positions, their outputs (NG * ND vectors)
  // and one value row (ND) in the 32 vector registers.
  constexpr int NG = ND <= 4 ? 4 : ND <= 8 ? 2 : 1;
  float* ob = a.out + b * n_q * D;
  for (int64_t h = 0; h < a.n_kv; ++h) {
    int64_t g0 = 0;
    for (; g0 + NG <= a.g; g0 += NG) weighted_values<ND, BF16, NG>(a, b, h, g0, lo, hi, sc, stride, ob);
    const int64_t rest = a.g - g0;  // < NG
    if constexpr (NG > 3) {
      if (rest == 3) weighted_values<ND, BF16, 3>(a, b, h, g0, lo, hi, sc, stride, ob);
    }
    if constexpr (NG > 2) {
      if (rest == 2) weighted_values<ND, BF16, 2>(a, b, h, g0, lo, hi, sc, stride, ob);
    }
    if constexpr (NG > 1) {
      if (rest == 1) weighted_values<ND, BF16, 1>(a, b, h, g0, lo, hi, sc, stride, ob);
    }
  }
  if (b + 1 < a.B) {  // the next sequence's first key page
    const int64_t nhi = a.lens[b + 1];
    const int64_t nlo = (a.window > 0 && nhi > a.window) ? nhi - a.window : 0;
    int64_t start, end;
    page_rows(a, b + 1, nlo / a.page, nlo, nhi, &start, &end);
    prefetch_rows(a.kc, row_bytes, start, end);
  }
}

template <int ND, bool BF16>
void run(const Args& a) {
  at::parallel_for(0, a.B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t b = begin; b < end; ++b) decode_one<ND, BF16>(a, b, scratch);
  });
}

}  // namespace

bool decode_attention_head_size_ok(int64_t d) {
  return d == 256 || (d > 0 && d <= 128 && d % 16 == 0);
}

#else  // not x86-64 with GCC/clang

bool decode_attention_head_size_ok(int64_t) { return false; }

#endif

void decode_attention_cpu(const torch::Tensor& q, const torch::Tensor& k_new,
                          const torch::Tensor& v_new, torch::Tensor kc, torch::Tensor vc,
                          const torch::Tensor& table, const torch::Tensor& lens, int64_t page,
                          int64_t window, double scale, torch::Tensor out) {
  TORCH_CHECK(avx512_supported(),
              "decode_attention: this CPU has no AVX-512; use the numba kernel");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "decode_attention: q must be a contiguous float32 [B, n_kv, g, D] tensor");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 &&
                  out.is_contiguous(),
              "decode_attention: out must be a contiguous float32 tensor shaped like q");
  const int64_t B = q.size(0), n_kv = q.size(1), g = q.size(2), D = q.size(3);
  const auto dt = kc.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16,
              "decode_attention: caches must be float32 or bfloat16");
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
#ifdef REALHF_X86
  Args a{q.data_ptr<float>(),
         static_cast<const char*>(k_new.data_ptr()),
         static_cast<const char*>(v_new.data_ptr()),
         static_cast<char*>(kc.data_ptr()),
         static_cast<char*>(vc.data_ptr()),
         table.data_ptr<int64_t>(),
         lens.data_ptr<int64_t>(),
         out.data_ptr<float>(),
         B, n_kv, g, table.size(1), page, window, static_cast<float>(scale)};
  const bool bf16 = dt == torch::kBFloat16;
  switch (D / 16) {
#define REALHF_DECODE_CASE(nd) \
  case nd:                     \
    return bf16 ? run<nd, true>(a) : run<nd, false>(a);
    REALHF_DECODE_CASE(1)
    REALHF_DECODE_CASE(2)
    REALHF_DECODE_CASE(3)
    REALHF_DECODE_CASE(4)
    REALHF_DECODE_CASE(5)
    REALHF_DECODE_CASE(6)
    REALHF_DECODE_CASE(7)
    REALHF_DECODE_CASE(8)
    REALHF_DECODE_CASE(16)
#undef REALHF_DECODE_CASE
  }
#endif
}

}  // namespace realhf
