// realhf's vector CPU kernels, built once per instruction set (see simd.h), and the choice
// between the builds.
//
// Every header is included before the target pragmas, so that only the kernels are compiled
// for AVX-512 or AVX2: nothing else in the extension may hold an instruction the CPU lacks.
#include "simd.h"

#include "kernels.h"

#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef REALHF_SIMD

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
#define REALHF_SIMD_AVX512
#define REALHF_SIMD_NS avx512
#include "simd_vec.h"
#include "decode_attention_simd.h"
#include "norm_rope_simd.h"
#include "vocab_logprob_simd.h"
#include "adamw_simd.h"
#include "gated_act_simd.h"
#include "decode_linear_simd.h"
#undef REALHF_SIMD_NS
#undef REALHF_SIMD_AVX512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define REALHF_SIMD_AVX2
#define REALHF_SIMD_NS avx2
#include "simd_vec.h"
#include "decode_attention_simd.h"
#include "norm_rope_simd.h"
#include "vocab_logprob_simd.h"
#include "adamw_simd.h"
#include "gated_act_simd.h"
#include "decode_linear_simd.h"
#undef REALHF_SIMD_NS
#undef REALHF_SIMD_AVX2
#pragma GCC pop_options

#endif

namespace realhf {

Isa cpu_isa() {
  static const Isa best = [] {
#ifdef REALHF_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
      return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
    return Isa::kNone;
  }();
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "";
  }
}

Isa isa_for(const std::string& name) {
  const Isa best = cpu_isa();
  TORCH_CHECK(best != Isa::kNone,
              "realhf's vector CPU kernels need AVX2 with FMA, or AVX-512, and a GCC build; "
              "this CPU or build has neither");
  if (name.empty()) return best;
  Isa isa = Isa::kNone;
  for (Isa i : {Isa::kAvx2, Isa::kAvx512})
    if (name == isa_name(i)) isa = i;
  TORCH_CHECK_VALUE(isa != Isa::kNone, "unknown instruction set '", name,
                    "': use 'avx512', 'avx2' or '' (the widest this CPU runs)");
  TORCH_CHECK_VALUE(static_cast<int>(isa) <= static_cast<int>(best), "this CPU does not run ",
                    name, "; the widest it runs is ", isa_name(best));
  return isa;
}

std::string simd_isa() { return isa_name(cpu_isa()); }

const SimdKernels& simd_kernels(Isa isa) {
#ifdef REALHF_SIMD
  static const SimdKernels k512{&avx512::decode_attention, &avx512::rms_norm, &avx512::rope,
                                &avx512::row_logsumexp, &avx512::row_softmax_grad,
                                &avx512::adamw, &avx512::sum_squares, &avx512::silu_mul,
                                &avx512::silu_mul_grad, &avx512::decode_linear};
  static const SimdKernels k2{&avx2::decode_attention, &avx2::rms_norm, &avx2::rope,
                             &avx2::row_logsumexp, &avx2::row_softmax_grad, &avx2::adamw,
                             &avx2::sum_squares, &avx2::silu_mul, &avx2::silu_mul_grad,
                             &avx2::decode_linear};
  if (isa == Isa::kAvx512) return k512;
  if (isa == Isa::kAvx2) return k2;
#endif
  TORCH_CHECK(false, "no vector CPU kernels for instruction set '", isa_name(isa), "'");
}

}  // namespace realhf
