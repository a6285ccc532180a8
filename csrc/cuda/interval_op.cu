// Flat-buffer interval copies on CUDA (semantics: ../interval_op.cpp and
// realhf.impl.kernels.slice_intervals / set_intervals).
//
// Like the CPU kernel, work is split by output elements: block b owns packed elements
// [b * kChunk, (b + 1) * kChunk), finds the interval holding its first element by binary
// search over the output offsets, then walks the intervals it overlaps; its threads copy
// each overlap with a coalesced stride. Intervals are validated on the host (they arrive
// as a CPU tensor), so one short host-to-device copy carries their starts and offsets.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "kernels_cuda.h"

namespace realhf {

namespace {

constexpr int64_t kChunk = 8192;
constexpr int kThreads = 256;

template <typename T, bool kToPacked>
__global__ void interval_copy_kernel(const int64_t* __restrict__ starts,
                                     const int64_t* __restrict__ offsets, int64_t n,
                                     T* __restrict__ flat, T* __restrict__ packed, int64_t total) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk;
  if (lo >= total) return;
  const int64_t hi = (lo + kChunk < total) ? lo + kChunk : total;
  // upper_bound(offsets[0..n], lo) - 1: the interval whose output range contains lo.
  int64_t a = 0, b = n + 1;
  while (a < b) {
    const int64_t m = (a + b) / 2;
    if (offsets[m] <= lo)
      a = m + 1;
    else
      b = m;
  }
  int64_t j = a - 1;
  for (int64_t pos = lo; pos < hi; ++j) {
    const int64_t seg_end = (offsets[j + 1] < hi) ? offsets[j + 1] : hi;
    const int64_t base = starts[j] - offsets[j];  // flat index = base + packed index
    for (int64_t p = pos + threadIdx.x; p < seg_end; p += blockDim.x) {
      if (kToPacked)
        packed[p] = flat[base + p];
      else
        flat[base + p] = packed[p];
    }
    pos = seg_end;
  }
}

// Host-side validation; returns [starts (N), offsets (N + 1)] on the host.
std::vector<int64_t> interval_table(const torch::Tensor& intervals_in, int64_t size,
                                    const char* what) {
  TORCH_CHECK(intervals_in.dim() == 2 && intervals_in.size(1) == 2, what,
              ": intervals must have shape [N, 2]");
  const auto iv = intervals_in.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t n = iv.size(0);
  const int64_t* p = iv.data_ptr<int64_t>();
  std::vector<int64_t> table(2 * n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = p[2 * i], e = p[2 * i + 1];
    TORCH_CHECK(0 <= s && s <= e && e <= size, what, ": interval ", i, " = [", s, ", ", e,
                ") must satisfy 0 <= start <= end <= ", size, " (the buffer size)");
    table[i] = s;
    table[n + i + 1] = table[n + i] + (e - s);
  }
  return table;
}

template <bool kToPacked>
void launch(const std::vector<int64_t>& table, const torch::Tensor& flat,
            const torch::Tensor& packed) {
  const int64_t n = (static_cast<int64_t>(table.size()) - 1) / 2;
  const int64_t total = table.back();
  if (total == 0) return;
  auto host = torch::from_blob(const_cast<int64_t*>(table.data()),
                               {static_cast<int64_t>(table.size())}, torch::kInt64);
  const auto dev = host.to(flat.device());  // synchronous: `table` outlives the copy
  const int64_t* starts = dev.data_ptr<int64_t>();
  const int64_t* offsets = starts + n;
  const int64_t blocks = (total + kChunk - 1) / kChunk;
  TORCH_CHECK(blocks <= INT32_MAX, "interval copy: buffer too large for one launch");
  auto stream = at::cuda::getCurrentCUDAStream();
#define REALHF_LAUNCH(T)                                                                  \
  interval_copy_kernel<T, kToPacked><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>( \
      starts, offsets, n, static_cast<T*>(flat.data_ptr()), static_cast<T*>(packed.data_ptr()), \
      total)
  switch (flat.element_size()) {
    case 1: REALHF_LAUNCH(uint8_t); break;
    case 2: REALHF_LAUNCH(uint16_t); break;
    case 4: REALHF_LAUNCH(uint32_t); break;
    case 8: REALHF_LAUNCH(uint64_t); break;
    default: TORCH_CHECK(false, "interval copy: unsupported element size ", flat.element_size());
  }
#undef REALHF_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

torch::Tensor slice_intervals_cuda(const torch::Tensor& src, const torch::Tensor& intervals,
                                   c10::optional<torch::Tensor> out) {
  TORCH_CHECK(src.is_cuda() && src.dim() == 1 && src.is_contiguous(),
              "slice_intervals_cuda: src must be a contiguous 1-D CUDA tensor");
  const c10::cuda::CUDAGuard guard(src.device());
  const auto table = interval_table(intervals, src.numel(), "slice_intervals_cuda");
  const int64_t total = table.back();
  torch::Tensor result;
  if (out.has_value()) {
    result = *out;
    TORCH_CHECK(result.device() == src.device() && result.dim() == 1 && result.is_contiguous() &&
                    result.scalar_type() == src.scalar_type() && result.numel() == total,
                "slice_intervals_cuda: out must be a contiguous 1-D tensor like src with ", total,
                " elements");
  } else {
    result = torch::empty({total}, src.options());
  }
  launch<true>(table, src, result);
  return result;
}

torch::Tensor set_intervals_cuda(const torch::Tensor& src, torch::Tensor dst,
                                 const torch::Tensor& intervals) {
  TORCH_CHECK(src.is_cuda() && dst.device() == src.device() && src.dim() == 1 &&
                  dst.dim() == 1 && src.is_contiguous() && dst.is_contiguous() &&
                  src.scalar_type() == dst.scalar_type(),
              "set_intervals_cuda: src and dst must be contiguous 1-D CUDA tensors of one dtype");
  const c10::cuda::CUDAGuard guard(src.device());
  const auto table = interval_table(intervals, dst.numel(), "set_intervals_cuda");
  TORCH_CHECK(src.numel() == table.back(), "set_intervals_cuda: src has ", src.numel(),
              " elements but the intervals cover ", table.back());
  launch<false>(table, dst, src);
  return dst;
}

}  // namespace realhf
