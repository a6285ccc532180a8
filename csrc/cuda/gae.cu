// Packed GAE on CUDA: one thread per sequence walks its steps backwards.
// Semantics: see ../gae.cpp and realhf.impl.kernels.gae_packed. Inputs are validated on
// the host by the Python wrapper; here only shapes, dtypes and devices are checked.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels_cuda.h"

namespace realhf {

namespace {

template <typename scalar_t>
__global__ void gae_packed_kernel(const scalar_t* __restrict__ rewards,
                                  const scalar_t* __restrict__ values,
                                  const int64_t* __restrict__ cu, const bool* __restrict__ boot,
                                  scalar_t* __restrict__ adv, scalar_t* __restrict__ ret,
                                  int64_t n_seqs, scalar_t gamma, scalar_t gamma_lam) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_seqs) return;
  const int64_t s = cu[i];
  const int64_t n = cu[i + 1] - s;
  const scalar_t* r = rewards + s;
  const scalar_t* v = values + s + i;
  scalar_t last = 0;
  for (int64_t t = n - 1; t >= 0; --t) {
    const scalar_t next_value = (t == n - 1 && !boot[i]) ? scalar_t(0) : v[t + 1];
    const scalar_t delta = r[t] + gamma * next_value - v[t];
    last = delta + gamma_lam * last;
    adv[s + t] = last;
    ret[s + t] = last + v[t];
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> gae_packed_cuda(const torch::Tensor& rewards_in,
                                                         const torch::Tensor& values_in,
                                                         const torch::Tensor& cu_seqlens,
                                                         const torch::Tensor& bootstrap,
                                                         double gamma, double lam) {
  TORCH_CHECK(rewards_in.is_cuda() && values_in.is_cuda() && cu_seqlens.is_cuda() &&
                  bootstrap.is_cuda(),
              "gae_packed_cuda: all tensors must be CUDA tensors");
  TORCH_CHECK(rewards_in.scalar_type() == values_in.scalar_type(),
              "gae_packed_cuda: rewards and values must share a dtype");
  const c10::cuda::CUDAGuard guard(rewards_in.device());
  const auto rewards = rewards_in.contiguous();
  const auto values = values_in.contiguous();
  const auto cu = cu_seqlens.to(torch::kInt64).contiguous();
  const auto boot = bootstrap.to(torch::kBool).contiguous();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(B >= 0 && boot.numel() == B && values.numel() == rewards.numel() + B,
              "gae_packed_cuda: expected cu_seqlens [B+1], bootstrap [B], values [T+B]");
  auto adv = torch::empty_like(rewards);
  auto ret = torch::empty_like(rewards);
  if (B == 0) return {adv, ret};
  constexpr int kThreads = 256;
  const int64_t blocks = (B + kThreads - 1) / kThreads;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "gae_packed_cuda", [&] {
    gae_packed_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        rewards.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), cu.data_ptr<int64_t>(),
        boot.data_ptr<bool>(), adv.data_ptr<scalar_t>(), ret.data_ptr<scalar_t>(), B,
        static_cast<scalar_t>(gamma), static_cast<scalar_t>(gamma * lam));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {adv, ret};
}

}  // namespace realhf
