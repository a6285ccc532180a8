// Declarations of realhf's CUDA kernels (bound in bindings.cpp as `realhf._C_cuda`).
// Same semantics as the CPU kernels in ../kernels.h; see realhf/impl/kernels.py.
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace realhf {

std::tuple<torch::Tensor, torch::Tensor> gae_packed_cuda(const torch::Tensor& rewards,
                                                         const torch::Tensor& values,
                                                         const torch::Tensor& cu_seqlens,
                                                         const torch::Tensor& bootstrap,
                                                         double gamma, double lam);

torch::Tensor slice_intervals_cuda(const torch::Tensor& src, const torch::Tensor& intervals,
                                   c10::optional<torch::Tensor> out);

torch::Tensor set_intervals_cuda(const torch::Tensor& src, torch::Tensor dst,
                                 const torch::Tensor& intervals);

}  // namespace realhf
