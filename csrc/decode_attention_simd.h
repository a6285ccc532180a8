// Decode attention over the paged KV cache, for one instruction set (included by
// simd.cpp once per instruction set, after simd_vec.h).
//
// The same contract as the numba kernel in realhf/impl/model/gen/cache_attention.py, which
// documents it and remains the path where these kernels cannot run: one query token per
// running sequence attends to the first lens[b] cached positions of its sequence, position
// t at pool row table[b][t / page] * page + t % page; the new token's key and value are
// stored at position lens[b] - 1 first. Caches are float32 or bfloat16 (widened to float32
// as they are read); arithmetic is float32.
//
// Why not numba alone: at real model shapes (7 query heads per kv head) the numba build is
// bound by its arithmetic, not by reading the cache, because LLVM reduces every dot product
// horizontally on its own and keeps the output in memory across rows. Here
//  - scores are made W keys at a time (W lanes per vector): W dot-product vectors reduced
//    together into one vector of W scores (sum_lanes), not W horizontal reductions;
//  - the weighted sum of values keeps up to 4 query heads' outputs in registers while a
//    page of value rows streams past, read from memory once for all heads;
//  - exp is a vector polynomial.

namespace realhf {
namespace REALHF_SIMD_NS {
namespace {

inline void prefetch_rows(const char* pool, int64_t row_bytes, int64_t start, int64_t end) {
  for (int64_t r = start; r < end; ++r)
    for (int64_t x = 0; x < row_bytes; x += 64) _mm_prefetch(pool + r * row_bytes + x, _MM_HINT_T0);
}

// The pool rows [start, end) sequence b reads on its page pg when it attends to [lo, hi).
inline void page_rows(const DecodeArgs& a, int64_t b, int64_t pg, int64_t lo, int64_t hi,
                      int64_t* start, int64_t* end) {
  int64_t base = a.table[b * a.width + pg] * a.page;
  *start = base + std::max<int64_t>(lo - pg * a.page, 0);
  *end = base + std::min<int64_t>(hi - pg * a.page, a.page);
}

// The weighted values of pool rows [start, end) (the sequence's positions t0, t0 + 1, ...)
// for query heads [g0, g0 + NG) of kv head h, added to their outputs in out (which `first`
// starts from 0). The outputs stay in registers while the rows stream past; an output
// carried from one page to the next goes through memory exactly (float32 both ways), so
// each sum is the same sequence of FMAs as over the whole sequence at once.
template <int D, bool BF16, int NG>
void weighted_values(const DecodeArgs& a, int64_t h, int64_t g0, int64_t start, int64_t end,
                     int64_t t0, const float* sc, int64_t stride, float* out, bool first) {
  constexpr int ND = D / W;
  constexpr int64_t elem = BF16 ? 2 : 4;
  const int64_t row_bytes = a.n_kv * D * elem;
  float* o = out + (h * a.g + g0) * D;
  F acc[NG][ND];
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < ND; ++c) acc[i][c] = first ? zero() : loadf(o + i * D + c * W);
  for (int64_t r = start, t = t0; r < end; ++r, ++t) {
    const char* vr = a.vc + r * row_bytes + h * D * elem;
    F p[NG];
    for (int i = 0; i < NG; ++i) p[i] = set1(sc[(h * a.g + g0 + i) * stride + t]);
    for (int c = 0; c < ND; ++c) {
      const F v = load<BF16>(vr + c * W * elem);
      for (int i = 0; i < NG; ++i) acc[i][c] = fmadd(p[i], v, acc[i][c]);
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < ND; ++c) storef(o + i * D + c * W, acc[i][c]);
}

// weighted_values for every query head, NG at a time (the rest, < NG, in one more call).
template <int D, bool BF16, int NG>
void values_of_rows(const DecodeArgs& a, int64_t start, int64_t end, int64_t t0,
                    const float* sc, int64_t stride, float* out, bool first) {
  for (int64_t h = 0; h < a.n_kv; ++h) {
    int64_t g0 = 0;
    for (; g0 + NG <= a.g; g0 += NG)
      weighted_values<D, BF16, NG>(a, h, g0, start, end, t0, sc, stride, out, first);
    const int64_t rest = a.g - g0;
    if constexpr (NG > 3) {
      if (rest == 3) weighted_values<D, BF16, 3>(a, h, g0, start, end, t0, sc, stride, out, first);
    }
    if constexpr (NG > 2) {
      if (rest == 2) weighted_values<D, BF16, 2>(a, h, g0, start, end, t0, sc, stride, out, first);
    }
    if constexpr (NG > 1) {
      if (rest == 1) weighted_values<D, BF16, 1>(a, h, g0, start, end, t0, sc, stride, out, first);
    }
  }
}

// Scaled scores of every query head against nb <= W key rows (pool rows, all kv heads):
// sc[(h * g + gi) * stride + j] for j < nb; lanes nb..W-1 are written too (0), within the
// row's stride (a multiple of 16).
template <int D, bool BF16>
void score_block(const DecodeArgs& a, const char* const* rows, int nb, const float* qb,
                 float* sc, int64_t stride) {
  constexpr int ND = D / W;
  constexpr int64_t elem = BF16 ? 2 : 4;
  alignas(64) float wide[BF16 ? W * D : 1];  // a bfloat16 block widened once per kv head
  for (int64_t h = 0; h < a.n_kv; ++h) {
    const float* keys[W];
    for (int j = 0; j < nb; ++j) {
      const char* kr = rows[j] + h * D * elem;
      if constexpr (BF16) {
        for (int c = 0; c < ND; ++c) storef(wide + j * D + c * W, load<true>(kr + c * W * 2));
        keys[j] = wide + j * D;
      } else {
        keys[j] = reinterpret_cast<const float*>(kr);
      }
    }
    for (int64_t gi = 0; gi < a.g; ++gi) {
      const float* qr = qb + (h * a.g + gi) * D;
      F qv[ND];
      for (int c = 0; c < ND; ++c) qv[c] = loadf(qr + c * W);
      F dots[W];
      for (int j = 0; j < W; ++j) {
        if (j < nb) {
          F s = mul(qv[0], loadf(keys[j]));
          for (int c = 1; c < ND; ++c) s = fmadd(qv[c], loadf(keys[j] + c * W), s);
          dots[j] = s;
        } else {
          dots[j] = zero();
        }
      }
      storef(sc + (h * a.g + gi) * stride, mul(sum_lanes(dots), set1(a.scale)));
    }
  }
}

// How many query heads' outputs weighted_values keeps in registers: NG * ND accumulators,
// NG broadcast weights and one value vector must fit (at most 4 heads, at least 1).
constexpr int heads_per_pass(int nd) {
  int ng = 4;
  while (ng > 1 && ng * (nd + 1) + 1 > kRegs) --ng;
  return ng;
}

template <int D, bool BF16>
void decode_one(const DecodeArgs& a, int64_t b, std::vector<float>& scratch) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const int64_t row_bytes = a.n_kv * D * elem;
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

  // Scores, W positions at a time (rows gathered across page ends into one block).
  const char* rows[W];
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
      if (nb == W) {
        score_block<D, BF16>(a, rows, nb, qb, sc + t0, stride);
        t0 += nb;
        nb = 0;
      }
    }
  }
  if (nb) score_block<D, BF16>(a, rows, nb, qb, sc + t0, stride);

  // Softmax of each query head's scores, less the row max (exp of raw scores overflows).
  for (int64_t j = 0; j < n_q; ++j) {
    float* row = sc + j * stride;
    for (int64_t t = n; t < stride; ++t) row[t] = -INFINITY;  // the last block's tail
    F m = set1(-INFINITY);
    for (int64_t t = 0; t < stride; t += W) m = max(m, loadf(row + t));
    const F mx = set1(reduce_max(m));
    F den = zero();
    for (int64_t t = 0; t < stride; t += W) {
      const F s = loadf(row + t);
      const F e = zero_where_neg_inf(exp_neg(sub(s, mx)), s);
      storef(row + t, e);
      den = add(den, e);
    }
    const F inv = set1(1.0f / reduce_add(den));
    for (int64_t t = 0; t < stride; t += W) storef(row + t, mul(loadf(row + t), inv));
  }

  // Values, a page at a time: every head's pass over a page's rows reads them from memory
  // once (the first pass) and from the cache after.
  constexpr int NG = heads_per_pass(D / W);
  float* ob = a.out + b * n_q * D;
  int64_t tv = 0;  // the first position of page pg
  for (int64_t pg = first; pg <= last; ++pg) {
    int64_t start, end;
    if (pg < last) {
      page_rows(a, b, pg + 1, lo, hi, &start, &end);
      prefetch_rows(a.vc, row_bytes, start, end);
    }
    page_rows(a, b, pg, lo, hi, &start, &end);
    values_of_rows<D, BF16, NG>(a, start, end, tv, sc, stride, ob, pg == first);
    tv += end - start;
  }
  if (b + 1 < a.B) {  // the next sequence's first key page
    const int64_t nhi = a.lens[b + 1];
    const int64_t nlo = (a.window > 0 && nhi > a.window) ? nhi - a.window : 0;
    int64_t start, end;
    page_rows(a, b + 1, nlo / a.page, nlo, nhi, &start, &end);
    prefetch_rows(a.kc, row_bytes, start, end);
  }
}

template <int D, bool BF16>
void decode_seqs(const DecodeArgs& a, int64_t b0, int64_t b1) {
  std::vector<float> scratch;
  for (int64_t b = b0; b < b1; ++b) decode_one<D, BF16>(a, b, scratch);
}

template <int D>
void decode_range(const DecodeArgs& a, int64_t b0, int64_t b1) {
  if (a.bf16) decode_seqs<D, true>(a, b0, b1);
  else decode_seqs<D, false>(a, b0, b1);
}

}  // namespace

// Head sizes: multiples of 16 up to 128, and 256 (decode_attention_head_size_ok).
void decode_attention(const DecodeArgs& a, int64_t b0, int64_t b1) {
  switch (a.D) {
    case 16: return decode_range<16>(a, b0, b1);
    case 32: return decode_range<32>(a, b0, b1);
    case 48: return decode_range<48>(a, b0, b1);
    case 64: return decode_range<64>(a, b0, b1);
    case 80: return decode_range<80>(a, b0, b1);
    case 96: return decode_range<96>(a, b0, b1);
    case 112: return decode_range<112>(a, b0, b1);
    case 128: return decode_range<128>(a, b0, b1);
    case 256: return decode_range<256>(a, b0, b1);
  }
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
