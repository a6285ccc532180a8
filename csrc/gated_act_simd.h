// The gated MLP's silu(gate) * up and its gradients, one pass each, for one instruction set
// (included by simd.cpp once per instruction set, after simd_vec.h).
//
// Through torch's ops a training step's SwiGLU runs silu, a product, and in backward silu
// again (modules/gated_act.py recomputes it), silu's backward and two products: ~10 passes
// over [T, intermediate] tensors per layer.  Here forward reads gate and up and writes the
// product; backward reads gate, up and the output's gradient and writes both input
// gradients.  The roundings are torch's: silu(gate) is rounded to the storage type before
// the product, and so is grad * up before silu's backward, so that in bf16 the results
// differ from torch's only where their sigmoids differ in the last float32 bits.

namespace realhf {
namespace REALHF_SIMD_NS {
namespace {

// sigmoid(x) from e = exp(-|x|) (never overflows): r = 1 / (1 + e), or e * r for x < 0
// (one division: the pass is bound by its arithmetic, not by memory).
inline F sigmoid(F x) {
  F e = exp_neg(sub(zero(), abs(x)));
  F r = div(set1(1.0f), add(set1(1.0f), e));
  return where_neg(x, mul(e, r), r);
}

template <bool BF16>
void silu_mul_span(const char* g, const char* u, char* out, int64_t i0, int64_t i1) {
  constexpr int64_t e = BF16 ? 2 : 4;
  for (int64_t i = i0; i < i1; i += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, i1 - i));
    F x = load_upto<BF16>(g + i * e, n);
    F a = round_to<BF16>(mul(x, sigmoid(x)));
    store_upto<BF16>(out + i * e, mul(a, load_upto<BF16>(u + i * e, n)), n);
  }
}

template <bool BF16>
void silu_mul_grad_span(const char* g, const char* u, const char* dy, char* dg, char* du,
                        int64_t i0, int64_t i1) {
  constexpr int64_t e = BF16 ? 2 : 4;
  const F one = set1(1.0f);
  for (int64_t i = i0; i < i1; i += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, i1 - i));
    F x = load_upto<BF16>(g + i * e, n), up = load_upto<BF16>(u + i * e, n);
    F d = load_upto<BF16>(dy + i * e, n), s = sigmoid(x);
    F a = round_to<BF16>(mul(x, s));                 // silu(gate), as forward rounded it
    F t = round_to<BF16>(mul(d, up));                // the gradient reaching silu
    F ds = mul(mul(t, s), add(one, mul(x, sub(one, s))));
    store_upto<BF16>(dg + i * e, ds, n);
    store_upto<BF16>(du + i * e, mul(d, a), n);
  }
}

}  // namespace

void silu_mul(const char* g, const char* u, char* out, int64_t i0, int64_t i1, bool bf16) {
  bf16 ? silu_mul_span<true>(g, u, out, i0, i1) : silu_mul_span<false>(g, u, out, i0, i1);
}

void silu_mul_grad(const char* g, const char* u, const char* dy, char* dg, char* du, int64_t i0,
                   int64_t i1, bool bf16) {
  bf16 ? silu_mul_grad_span<true>(g, u, dy, dg, du, i0, i1)
       : silu_mul_grad_span<false>(g, u, dy, dg, du, i0, i1);
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
