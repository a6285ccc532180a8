// Flat-buffer interval copies for parameter reallocation (CPU).
//
// A model's local parameters live in one flat buffer; moving them between parallel
// layouts sends only some index intervals. slice_intervals packs those intervals into a
// contiguous buffer, set_intervals unpacks one. Both are plain byte copies, so any dtype
// works (fp32, fp16 and bf16 are the ones used).
//
// Work is split by *output bytes*, not by interval: each task owns an equal share of the
// packed buffer and finds its first interval by binary search over the output offsets.
// That balances one huge interval and thousands of tiny ones alike.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include "kernels.h"

namespace realhf {

namespace {

// Below this many bytes a single thread is faster than waking the pool.
constexpr int64_t kParallelBytes = 1 << 20;
// Above this many bytes (beyond a typical last-level cache) the destination is written with
// non-temporal stores, see copy_bytes.
constexpr int64_t kStreamingBytes = 32 << 20;

// memcpy, optionally with non-temporal (cache-bypassing) stores. Interval pieces are small,
// so plain memcpy uses ordinary stores, which first read every destination cache line:
// three memory transfers per byte instead of two. A single huge memcpy avoids that by
// streaming (glibc does), so without this the interval copy tops out near 2/3 of memcpy
// bandwidth on large buffers. The caller issues the store fence.
inline void copy_bytes(char* dst, const char* src, int64_t n, bool streaming) {
#if defined(__SSE2__)
  if (streaming && n >= 256) {
    const int64_t head = (16 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const int64_t body = n & ~int64_t(63);
    for (int64_t k = 0; k < body; k += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 48), d);
    }
    std::memcpy(dst + body, src + body, n - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Validates intervals [N, 2] (int64, CPU) against a buffer of `size` elements and returns
// the exclusive prefix sum of their lengths (N + 1 entries).
std::vector<int64_t> interval_offsets(const torch::Tensor& intervals, int64_t size,
                                      const char* what) {
  TORCH_CHECK(intervals.device().is_cpu() && intervals.scalar_type() == torch::kInt64 &&
                  intervals.dim() == 2 && intervals.size(1) == 2 && intervals.is_contiguous(),
              what, ": intervals must be a contiguous int64 CPU tensor of shape [N, 2]");
  const int64_t n = intervals.size(0);
  const int64_t* iv = intervals.data_ptr<int64_t>();
  std::vector<int64_t> offsets(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = iv[2 * i], e = iv[2 * i + 1];
    TORCH_CHECK(0 <= s && s <= e && e <= size, what, ": interval ", i, " = [", s, ", ", e,
                ") must satisfy 0 <= start <= end <= ", size, " (the buffer size)");
    offsets[i + 1] = offsets[i] + (e - s);
  }
  return offsets;
}

// Copies between the packed buffer and the intervals of the flat buffer.
// to_packed: packed[off_i + k] = flat[s_i + k]; otherwise the reverse.
void copy_intervals(const int64_t* iv, const std::vector<int64_t>& offsets, char* flat,
                    char* packed, int64_t elem, bool to_packed) {
  const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t total = offsets[n];
  if (total == 0) return;
  const int64_t n_tasks =
      total * elem < kParallelBytes ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const bool streaming = total * elem >= kStreamingBytes;
  at::parallel_for(0, n_tasks, 1, [&](int64_t tb, int64_t te) {
    for (int64_t task = tb; task < te; ++task) {
      int64_t lo = total * task / n_tasks;
      const int64_t hi = total * (task + 1) / n_tasks;
      // First interval whose output range contains lo (skips empty intervals).
      int64_t i = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
      while (lo < hi) {
        const int64_t take = std::min(hi, offsets[i + 1]) - lo;
        if (take > 0) {
#if defined(__SSE2__)
          // Reads that jump between small pieces defeat the hardware prefetcher (it
          // restarts at each new page); ask for the head of the next piece early.
          if (streaming && to_packed && i + 1 < n) {
            const char* next = flat + iv[2 * (i + 1)] * elem;
            for (int line = 0; line < 2048; line += 64) _mm_prefetch(next + line, _MM_HINT_NTA);
          }
#endif
          char* f = flat + (iv[2 * i] + (lo - offsets[i])) * elem;
          char* p = packed + lo * elem;
          if (to_packed)
            copy_bytes(p, f, take * elem, streaming);
          else
            copy_bytes(f, p, take * elem, streaming);
          lo += take;
        }
        ++i;
      }
    }
#if defined(__SSE2__)
    if (streaming) _mm_sfence();  // order the non-temporal stores before returning
#endif
  });
}

}  // namespace

torch::Tensor slice_intervals_cpu(const torch::Tensor& src, const torch::Tensor& intervals,
                                  c10::optional<torch::Tensor> out) {
  TORCH_CHECK(src.device().is_cpu() && src.dim() == 1 && src.is_contiguous(),
              "slice_intervals_cpu: src must be a contiguous 1-D CPU tensor");
  const auto offsets = interval_offsets(intervals, src.numel(), "slice_intervals_cpu");
  const int64_t total = offsets.back();
  torch::Tensor result;
  if (out.has_value()) {
    result = *out;
    TORCH_CHECK(result.device().is_cpu() && result.dim() == 1 && result.is_contiguous() &&
                    result.scalar_type() == src.scalar_type() && result.numel() == total,
                "slice_intervals_cpu: out must be a contiguous 1-D CPU tensor of dtype ",
                src.scalar_type(), " with ", total, " elements");
  } else {
    result = torch::empty({total}, src.options());
  }
  copy_intervals(intervals.data_ptr<int64_t>(), offsets, static_cast<char*>(src.data_ptr()),
                 static_cast<char*>(result.data_ptr()), src.element_size(), true);
  return result;
}

torch::Tensor set_intervals_cpu(const torch::Tensor& src, torch::Tensor dst,
                                const torch::Tensor& intervals) {
  TORCH_CHECK(src.device().is_cpu() && src.dim() == 1 && src.is_contiguous() &&
                  dst.device().is_cpu() && dst.dim() == 1 && dst.is_contiguous(),
              "set_intervals_cpu: src and dst must be contiguous 1-D CPU tensors");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "set_intervals_cpu: src is ",
              src.scalar_type(), " but dst is ", dst.scalar_type());
  const auto offsets = interval_offsets(intervals, dst.numel(), "set_intervals_cpu");
  TORCH_CHECK(src.numel() == offsets.back(), "set_intervals_cpu: src has ", src.numel(),
              " elements but the intervals cover ", offsets.back());
  copy_intervals(intervals.data_ptr<int64_t>(), offsets, static_cast<char*>(dst.data_ptr()),
                 static_cast<char*>(src.data_ptr()), src.element_size(), false);
  return dst;
}

torch::Tensor merge_intervals(const torch::Tensor& intervals_in) {
  TORCH_CHECK(intervals_in.dim() == 2 && intervals_in.size(1) == 2,
              "merge_intervals: intervals must have shape [N, 2]");
  const auto intervals = intervals_in.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t n = intervals.size(0);
  const int64_t* iv = intervals.data_ptr<int64_t>();
  std::vector<int64_t> merged;
  merged.reserve(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    if (!merged.empty() && merged.back() == iv[2 * i]) {
      merged.back() = iv[2 * i + 1];
    } else {
      merged.push_back(iv[2 * i]);
      merged.push_back(iv[2 * i + 1]);
    }
  }
  const int64_t m = static_cast<int64_t>(merged.size()) / 2;
  auto out = torch::empty({m, 2}, torch::kInt64);
  std::copy(merged.begin(), merged.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace realhf
