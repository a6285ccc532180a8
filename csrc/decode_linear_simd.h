// x @ W.T for the few rows of a decode step, float32, for one instruction set (included by
// simd.cpp once per instruction set, after simd_vec.h).
//
// At 16 rows a float32 decode product is bound by both the arithmetic and the memory: each
// weight is read once and used for 16 multiply-adds, which on a 2-core AVX-512 CPU take about
// as long as reading it.  The two then have to overlap.  W [N, K] is packed as blocks of 16
// output columns, [ceil(N / 16), K, 16] (the last block padded with zeros), so a block is one
// stream of memory: for each k, its 16 weights are one cache line, multiplied into one
// accumulator vector (two for AVX2) per row by x[row, k] broadcast.  The block is read
// ahead with prefetches (the hardware prefetcher alone leaves the core waiting on memory
// between FMAs: 6.5 against 17.5 GB/s in a probe of 0.5B-MLP matrices), and rows beyond what
// the registers hold take further passes over the block, which is then in the core's cache.

namespace realhf {
namespace REALHF_SIMD_NS {
namespace {

constexpr int kCols = 16;                    // output columns per packed block (both builds)
constexpr int kColVecs = kCols / W;          // vectors per k in a block
constexpr int kPassRows = W == 16 ? 16 : 6;  // rows per pass: kPassRows * kColVecs accumulators
constexpr int64_t kAhead = 24;               // prefetch distance in k (cache lines)

// y[m0 + r, n0 : n0 + 16] for r < R (the first `valid` columns of the block), from the
// block's weights w [K, 16] and x transposed, xt [K, M]; bias the block's 16 (or null).
template <int R>
void block_rows(const float* xt, int64_t M, int64_t m0, const float* w, const float* bias,
                float* y, int64_t N, int64_t n0, int64_t K, int valid, bool ahead) {
  F acc[R][kColVecs];
  for (int v = 0; v < kColVecs; ++v) {
    const F b = bias ? loadf(bias + v * W) : zero();
    for (int r = 0; r < R; ++r) acc[r][v] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kCols;
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kCols), _MM_HINT_T0);
    F wv[kColVecs];
    for (int v = 0; v < kColVecs; ++v) wv[v] = loadf(wk + v * W);
    const float* xk = xt + k * M + m0;
    for (int r = 0; r < R; ++r) {
      const F xv = set1(xk[r]);
      for (int v = 0; v < kColVecs; ++v) acc[r][v] = fmadd(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = y + (m0 + r) * N + n0;
    for (int v = 0; v < kColVecs; ++v) {
      const int n = valid - v * W;
      if (n >= W) storef(out + v * W, acc[r][v]);
      else if (n > 0) store_n<false>(out + v * W, acc[r][v], n);
    }
  }
}

// block_rows<r> for a run-time r in [1, R].
template <int R>
void block_rows_upto(int r, const float* xt, int64_t M, int64_t m0, const float* w,
                     const float* bias, float* y, int64_t N, int64_t n0, int64_t K, int valid,
                     bool ahead) {
  if (r == R) return block_rows<R>(xt, M, m0, w, bias, y, N, n0, K, valid, ahead);
  if constexpr (R > 1) block_rows_upto<R - 1>(r, xt, M, m0, w, bias, y, N, n0, K, valid, ahead);
}

}  // namespace

// Blocks [nb0, nb1) of y [M, N] = x @ W.T + bias, from xt [K, M] (x transposed), the packed
// wp [ceil(N / 16), K, 16] and the padded bias [ceil(N / 16) * 16] (or null).
void decode_linear(const float* xt, int64_t M, const float* wp, const float* bias, float* y,
                   int64_t N, int64_t K, int64_t nb0, int64_t nb1) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const float* w = wp + nb * K * kCols;
    const float* b = bias ? bias + nb * kCols : nullptr;
    const int valid = static_cast<int>(std::min<int64_t>(kCols, N - nb * kCols));
    for (int64_t m0 = 0; m0 < M; m0 += kPassRows) {
      const int r = static_cast<int>(std::min<int64_t>(kPassRows, M - m0));
      // (later passes find the block in the cache)
      block_rows_upto<kPassRows>(r, xt, M, m0, w, b, y, N, nb * kCols, K, valid, m0 == 0);
    }
  }
}

}  // namespace REALHF_SIMD_NS
}  // namespace realhf
