// Declarations of realhf's CPU kernels (bound to Python in bindings.cpp).
// Semantics are documented in realhf/impl/kernels.py, next to the pure-PyTorch
// references the tests compare them against.
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace realhf {

// Packed GAE. rewards[T], values[T+B], cu_seqlens[B+1] (int32/int64), bootstrap[B] bool.
std::tuple<torch::Tensor, torch::Tensor> gae_packed_cpu(const torch::Tensor& rewards,
                                                        const torch::Tensor& values,
                                                        const torch::Tensor& cu_seqlens,
                                                        const torch::Tensor& bootstrap,
                                                        double gamma, double lam);

// out = concat(src[s:e] for (s, e) in intervals); intervals is int64 [N, 2] on CPU.
torch::Tensor slice_intervals_cpu(const torch::Tensor& src, const torch::Tensor& intervals,
                                  c10::optional<torch::Tensor> out);

// dst[s:e] = consecutive pieces of src, in place; returns dst.
torch::Tensor set_intervals_cpu(const torch::Tensor& src, torch::Tensor dst,
                                const torch::Tensor& intervals);

// Fuse (s, e) with the previous interval when prev.e == s; single pass, order kept.
torch::Tensor merge_intervals(const torch::Tensor& intervals);

}  // namespace realhf
