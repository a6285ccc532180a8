// AdamW on float32 master weights in one pass per element, and the sum of squares of a
// gradient (its norm), for one instruction set (included by simd.cpp once per instruction
// set, after simd_vec.h).
//
// A bf16 model trains against float32 master weights and moments (realhf/impl/model/
// backend/train.py).  With torch's ops a step converts the bf16 gradient into a float32
// buffer, scales it by the clipping coefficient, runs the fused AdamW over master weights,
// moments and that buffer, then copies the master weights into the model in bf16: ~48 bytes
// of memory traffic per parameter.  Here each element's gradient is read in its own dtype,
// scaled, applied, and the new weight written to the master and, rounded to bf16, to the
// model: 28 bytes.
//
// Per element, in float32 (the order of torch's AdamW, decoupled weight decay):
//   g = grad * coef;  p *= 1 - lr * wd;  m = b1 * m + (1 - b1) * g;
//   v = b2 * v + (1 - b2) * g * g;  p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with step_size = lr / (1 - b1^t) and bc2_sqrt = sqrt(1 - b2^t) (t: the step count after
// this step), both computed in double by the caller.  The results agree with torch's AdamW
// to a few ulps (it rounds its scalars and orders its products its own way).

namespace realhf {
namespace REALHF_SIMD_NS {
namespace {

template <bool GBF16, bool OUT>
void adamw_span(float* p, float* m, float* v, const char* g, uint16_t* low, int64_t i0,
                int64_t i1, const AdamWArgs& a) {
  constexpr int64_t ge = GBF16 ? 2 : 4;
  const F coef = set1(a.grad_coef), decay = set1(a.decay), b1 = set1(a.beta1),
          c1 = set1(1.0f - a.beta1), b2 = set1(a.beta2), c2 = set1(1.0f - a.beta2),
          step = set1(a.step_size), bc2 = set1(a.bc2_sqrt), eps = set1(a.eps);
  int64_t i = i0;
  for (; i + W <= i1; i += W) {
    F gi = mul(load<GBF16>(g + i * ge), coef);
    F pi = mul(loadf(p + i), decay);
    F mi = add(mul(b1, loadf(m + i)), mul(c1, gi));
    F vi = add(mul(b2, loadf(v + i)), mul(c2, mul(gi, gi)));
    F denom = add(div(sqrt(vi), bc2), eps);
    pi = sub(pi, div(mul(step, mi), denom));
    storef(m + i, mi);
    storef(v + i, vi);
    storef(p + i, pi);
    if constexpr (OUT) store<true>(low + i, pi);
  }
  if (i < i1) {  // the last < W elements, masked: the same operations
    const int n = static_cast<int>(i1 - i);
    F gi = mul(load_n<GBF16>(g + i * ge, n), coef);
    F pi = mul(load_n<false>(p + i, n), decay);
    F mi = add(mul(b1, load_n<false>(m + i, n)), mul(c1, gi));
    F vi = add(mul(b2, load_n<false>(v + i, n)), mul(c2, mul(gi, gi)));
    F denom = add(div(sqrt(vi), bc2), eps);
    pi = sub(pi, div(mul(step, mi), denom));
    store_n<false>(m + i, mi, n);
    store_n<false>(v + i, vi, n);
    store_n<false>(p + i, pi, n);
    if constexpr (OUT) store_n<true>(low + i, pi, n);
  }
}

}  // namespace

// Sum of squares of elements [i0, i1) of x (bfloat16 when bf16, else float32): four float32
// vector accumulators, then their lanes added in double.  The same for a bf16 tensor and its
// float32 conversion, to the bit.
double sum_squares(const char* x, bool bf16, int64_t i0, int64_t i1) {
  const int64_t e = bf16 ? 2 : 4;
  F acc[4] = {zero(), zero(), zero(), zero()};
  int64_t i = i0;
  for (; i + 4 * W <= i1; i += 4 * W)
    for (int k = 0; k < 4; ++k) {
      F v = bf16 ? load<true>(x + (i + k * W) * e) : load<false>(x + (i + k * W) * e);
      acc[k] = fmadd(v, v, acc[k]);
    }
  for (; i < i1; i += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, i1 - i));
    F v = bf16 ? load_n<true>(x + i * e, n) : load_n<false>(x + i * e, n);
    acc[0] = fmadd(v, v, acc[0]);
  }
  double total = 0;
  for (int k = 0; k < 4; ++k) {
    float lanes[W];
    storef(lanes, acc[k]);
    for (int j = 0; j < W; ++j) total += lanes[j];
  }
  return total;
}

void adamw(float* p, float* m, float* v, const char* g, bool g_bf16, uint16_t* low, int64_t i0,
           int64_t i1, const AdamWArgs& a) {
  if (g_bf16)
    low ? adamw_span<true, true>(p, m, v, g, low, i0, i1, a)
        : adamw_span<true, false>(p, m, v, g, low, i0, i1, a);
  else
    low ? adamw_span<false, true>(p, m, v, g, low, i0, i1, a)
        : adamw_span<false, false>(p, m, v, g, low, i0, i1, a);
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
