// Log-softmax statistics and gradients over a large vocabulary, row by row, for one
// instruction set (included by simd.cpp once per instruction set, after simd_vec.h).
//
// Training's token log-probs (realhf/impl/model/modules/vocab_chunked.py) read the
// [T, V] logits (V ~152k) in the model's dtype. With torch's ops each block of rows is
// converted to a float32 copy, then max, subtract, exp and sum each pass over it (backward:
// copy, subtract, exp, multiply, scatter, convert back): ~50 bytes of memory traffic per
// logit, most of a bf16 step's non-product time at a 152k vocabulary. Here a row is read in
// its own dtype, twice while it sits in L2 (max, then the sum of exps), and backward
// writes each gradient row once: ~6 bytes per logit.
//
// z - c = x / t - c is rounded as torch rounds it (a division, then a subtraction, never
// fused), and exp is the polynomial of simd_vec.h (relative error ~1e-7): results agree with
// the float32 torch ops to ~1e-6 relative (the sums run in another order). A row holding a
// NaN or an infinity gives NaN statistics (torch's ops give NaN or inf there too; the
// trainer skips a step whose loss or gradient is not finite).

namespace realhf {
namespace REALHF_SIMD_NS {
namespace {

// Element j of a row, as float32.
template <bool BF16>
inline float at(const char* x, int64_t j) {
  if constexpr (BF16) {
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(x)[j]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return reinterpret_cast<const float*>(x)[j];
  }
}

// Max of the row's x, and NaN when one of them is not finite.
template <bool BF16>
inline float row_max(const char* x, int64_t V) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  F mx = set1(-INFINITY), chk = zero();
  int64_t i = 0;
  for (; i + W <= V; i += W) {
    F v = load<BF16>(x + i * elem);
    mx = max(mx, v);
    chk = fmadd(v, zero(), chk);  // 0, or NaN from a NaN or an infinity
  }
  float m = reduce_max(mx), bad = reduce_add(chk);
  for (; i < V; ++i) {
    m = std::max(m, at<BF16>(x, i));
    bad += at<BF16>(x, i) * 0.0f;
  }
  return std::isnan(bad) ? NAN : m;
}

constexpr int64_t kBlock = 2048;  // a multiple of 2 * W

template <bool BF16>
void lse_rows(const char* x, int64_t xs, int64_t V, const int64_t* rows, int64_t i0, int64_t i1,
              float t, float* m_out, float* s_out) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const F tv = set1(t);
  for (int64_t n = i0; n < i1; ++n) {
    const char* xr = x + rows[n] * xs * elem;
    const float m = row_max<BF16>(xr, V) / t;  // t > 0: the max of x / t
    const F mv = set1(m);
    // Summed in two levels (within blocks of kBlock entries, then over the blocks), so
    // that rounding grows with ~kBlock / W + V / kBlock additions, not V / W: the error of
    // the log-sum-exp stays near that of torch's reduction at a 152k vocabulary.
    const int64_t whole = V / (2 * W) * (2 * W);
    F total = zero();
    for (int64_t b = 0; b < whole; b += kBlock) {
      F s0 = zero(), s1 = zero();
      for (int64_t i = b, e = std::min(whole, b + kBlock); i < e; i += 2 * W) {
        s0 = add(s0, exp_neg(sub(div(load<BF16>(xr + i * elem), tv), mv)));
        s1 = add(s1, exp_neg(sub(div(load<BF16>(xr + (i + W) * elem), tv), mv)));
      }
      total = add(total, add(s0, s1));
    }
    float tail = 0.0f;
    for (int64_t i = whole; i < V; ++i) tail += std::exp(at<BF16>(xr, i) / t - m);
    m_out[n] = m;
    s_out[n] = reduce_add(total) + tail;
  }
}

template <bool BF16>
void grad_rows(const char* x, int64_t xs, int64_t V, const int64_t* rows, int64_t i0, int64_t i1,
               float t, const float* lse, const float* coef, const int64_t* label,
               const float* label_add, char* g, int64_t gs) {
  constexpr int64_t elem = BF16 ? 2 : 4;
  const F tv = set1(t);
  for (int64_t n = i0; n < i1; ++n) {
    const char* xr = x + rows[n] * xs * elem;
    char* gr = g + rows[n] * gs * elem;
    // (a NaN lse, from a row that was not finite, makes the row's gradient NaN: exp_neg
    // would turn it into a number)
    const F l = set1(lse[n]), c = set1(std::isnan(lse[n]) ? NAN : coef[n]);
    for (int64_t i = 0; i < V; i += W) {
      const int k = static_cast<int>(std::min<int64_t>(W, V - i));
      F p = exp_neg(sub(div(load_upto<BF16>(xr + i * elem, k), tv), l));
      store_upto<BF16>(gr + i * elem, mul(c, p), k);
    }
    // The label's entry again, with its one-hot term added before rounding.
    const int64_t y = label[n];
    F p = exp_neg(sub(div(load_n<BF16>(xr + y * elem, 1), tv), l));
    store_n<BF16>(gr + y * elem, fmadd(c, p, set1(label_add[n])), 1);
  }
}

}  // namespace

void row_logsumexp(const char* x, int64_t xs, int64_t V, const int64_t* rows, int64_t i0,
                   int64_t i1, float t, float* m, float* s, bool bf16) {
  if (bf16) lse_rows<true>(x, xs, V, rows, i0, i1, t, m, s);
  else lse_rows<false>(x, xs, V, rows, i0, i1, t, m, s);
}

void row_softmax_grad(const char* x, int64_t xs, int64_t V, const int64_t* rows, int64_t i0,
                      int64_t i1, float t, const float* lse, const float* coef,
                      const int64_t* label, const float* label_add, char* g, int64_t gs,
                      bool bf16) {
  if (bf16) grad_rows<true>(x, xs, V, rows, i0, i1, t, lse, coef, label, label_add, g, gs);
  else grad_rows<false>(x, xs, V, rows, i0, i1, t, lse, coef, label, label_add, g, gs);
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
