// Generalised advantage estimation over a packed batch of sequences (CPU).
//
// Sequence i owns rewards[cu[i] : cu[i+1]] (n_i steps) and values[cu[i] + i : cu[i+1] + i + 1]
// (n_i + 1 values: one per step plus the value of the state after the last step). Going
// backwards over its steps t = n_i - 1 .. 0:
//   next_value = (t == n_i - 1 && !bootstrap[i]) ? 0 : v[t + 1]
//   delta      = r[t] + gamma * next_value - v[t]
//   adv[t]     = delta + gamma * lam * adv[t + 1]      (adv[n_i] = 0)
//   ret[t]     = adv[t] + v[t]
// Sequences are independent, so they are spread over threads with at::parallel_for
// (OpenMP in the CPU builds of torch), which honours torch.set_num_threads.
#include <ATen/Parallel.h>

#include "kernels.h"

namespace realhf {

namespace {

template <typename scalar_t>
void gae_one_sequence(const scalar_t* r, const scalar_t* v, scalar_t* adv, scalar_t* ret,
                      int64_t n, bool bootstrap, scalar_t gamma, scalar_t gamma_lam) {
  scalar_t last = 0;
  for (int64_t t = n - 1; t >= 0; --t) {
    const scalar_t next_value = (t == n - 1 && !bootstrap) ? scalar_t(0) : v[t + 1];
    const scalar_t delta = r[t] + gamma * next_value - v[t];
    last = delta + gamma_lam * last;
    adv[t] = last;
    ret[t] = last + v[t];
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> gae_packed_cpu(const torch::Tensor& rewards_in,
                                                        const torch::Tensor& values_in,
                                                        const torch::Tensor& cu_seqlens_in,
                                                        const torch::Tensor& bootstrap_in,
                                                        double gamma, double lam) {
  TORCH_CHECK(rewards_in.device().is_cpu() && values_in.device().is_cpu() &&
                  cu_seqlens_in.device().is_cpu() && bootstrap_in.device().is_cpu(),
              "gae_packed_cpu: all tensors must be on the CPU");
  TORCH_CHECK(rewards_in.dim() == 1 && values_in.dim() == 1 && cu_seqlens_in.dim() == 1 &&
                  bootstrap_in.dim() == 1,
              "gae_packed_cpu: rewards, values, cu_seqlens and bootstrap must be 1-D");
  TORCH_CHECK(rewards_in.scalar_type() == values_in.scalar_type(),
              "gae_packed_cpu: rewards are ", rewards_in.scalar_type(), " but values are ",
              values_in.scalar_type());
  const auto rewards = rewards_in.contiguous();
  const auto values = values_in.contiguous();
  const auto cu = cu_seqlens_in.to(torch::kInt64).contiguous();
  const auto boot = bootstrap_in.to(torch::kBool).contiguous();
  const int64_t B = cu.numel() - 1;
  const int64_t T = rewards.numel();
  TORCH_CHECK(B >= 0, "gae_packed_cpu: cu_seqlens needs at least one entry (a leading 0)");
  TORCH_CHECK(boot.numel() == B, "gae_packed_cpu: bootstrap has ", boot.numel(),
              " entries for ", B, " sequences");
  TORCH_CHECK(values.numel() == T + B, "gae_packed_cpu: values must have T + B = ", T + B,
              " entries (one extra per sequence), got ", values.numel());
  const int64_t* cu_p = cu.data_ptr<int64_t>();
  TORCH_CHECK(cu_p[0] == 0 && cu_p[B] == T, "gae_packed_cpu: cu_seqlens must run from 0 to T = ",
              T, ", got ", cu_p[0], " .. ", cu_p[B]);
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(cu_p[i + 1] >= cu_p[i], "gae_packed_cpu: cu_seqlens decreases at sequence ", i);
  }
  auto adv = torch::empty_like(rewards);
  auto ret = torch::empty_like(rewards);
  const bool* boot_p = boot.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES(rewards.scalar_type(), "gae_packed_cpu", [&] {
    const scalar_t* r = rewards.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    scalar_t* a = adv.data_ptr<scalar_t>();
    scalar_t* o = ret.data_ptr<scalar_t>();
    const auto g = static_cast<scalar_t>(gamma);
    const auto gl = static_cast<scalar_t>(gamma * lam);
    // A grain of 256 sequences keeps tiny batches on one thread.
    at::parallel_for(0, B, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = cu_p[i];
        gae_one_sequence<scalar_t>(r + s, v + s + i, a + s, o + s, cu_p[i + 1] - s, boot_p[i], g,
                                   gl);
      }
    });
  });
  return {adv, ret};
}

}  // namespace realhf
