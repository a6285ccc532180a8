// Python bindings of realhf's CPU kernels: the extension module `realhf._C`.
// The GIL is released while a kernel runs so other Python threads keep going.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "realhf CPU kernels: packed GAE, flat-buffer interval copies, decode attention, inference RMSNorm and RoPE, vocabulary log-softmax, AdamW on master weights, the gated MLP activation";
  namespace py = pybind11;
  m.def("gae_packed", &realhf::gae_packed_cpu, "Packed GAE (see realhf.impl.kernels.gae_packed)",
        py::arg("rewards"), py::arg("values"), py::arg("cu_seqlens"), py::arg("bootstrap"),
        py::arg("gamma"), py::arg("lam"), py::call_guard<py::gil_scoped_release>());
  m.def("slice_intervals", &realhf::slice_intervals_cpu,
        "Concatenate src[s:e] over intervals [N, 2]", py::arg("src"), py::arg("intervals"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("set_intervals", &realhf::set_intervals_cpu,
        "Write consecutive pieces of src into dst[s:e] in place", py::arg("src"), py::arg("dst"),
        py::arg("intervals"), py::call_guard<py::gil_scoped_release>());
  m.def("merge_intervals", &realhf::merge_intervals,
        "Fuse intervals whose start equals the previous end (order kept)", py::arg("intervals"));
  m.def("simd_isa", &realhf::simd_isa,
        "The widest build of the vector kernels (decode_attention, rms_norm, rope, "
        "row_logsumexp, row_softmax_grad, adamw_step, sum_squares, silu_mul, decode_linear) "
        "this CPU runs: 'avx512', 'avx2' or '' (none)");
  m.def("decode_attention", &realhf::decode_attention_cpu,
        "Decode attention over the paged KV cache (see realhf.impl.model.gen.cache_attention)",
        py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("kc"), py::arg("vc"),
        py::arg("table"), py::arg("lens"), py::arg("page"), py::arg("window"), py::arg("scale"),
        py::arg("out"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention_head_size_ok", &realhf::decode_attention_head_size_ok,
        "Whether decode_attention takes this head size", py::arg("head_dim"));
  m.def("rms_norm", &realhf::rms_norm_cpu, "Inference RMSNorm (see csrc/norm_rope_simd.h)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope", &realhf::rope_cpu, "Inference rotary embedding (see csrc/norm_rope_simd.h)",
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("row_logsumexp", &realhf::row_logsumexp_cpu,
        "Per selected row of [T, V] logits: max of logits / t and the sum of exps below it "
        "(see csrc/vocab_logprob_simd.h)",
        py::arg("logits"), py::arg("rows"), py::arg("temperature"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("row_softmax_grad", &realhf::row_softmax_grad_cpu,
        "Gradient rows coef * softmax(logits / t) plus a one-hot term (see "
        "csrc/vocab_logprob_simd.h)",
        py::arg("logits"), py::arg("rows"), py::arg("lse"), py::arg("coef"), py::arg("label"),
        py::arg("label_add"), py::arg("temperature"), py::arg("grad"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("adamw_step", &realhf::adamw_step_cpu,
        "AdamW on float32 master weights from a float32 or bfloat16 gradient, the new "
        "weights also written in bfloat16 (see csrc/adamw_simd.h)",
        py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
        py::arg("low"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("weight_decay"), py::arg("eps"), py::arg("step"), py::arg("grad_coef") = 1.0,
        py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());
  m.def("sum_squares", &realhf::sum_squares_cpu,
        "Sum of squares of a float32 or bfloat16 tensor, in double (see csrc/kernels.h)",
        py::arg("x"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &realhf::silu_mul_cpu,
        "silu(gate) * up in one pass (see csrc/gated_act_simd.h)", py::arg("gate"),
        py::arg("up"), py::arg("isa") = "", py::call_guard<py::gil_scoped_release>());
  m.def("decode_linear", &realhf::decode_linear_cpu,
        "x @ W.T + bias for a decode step's rows, float32, W packed in blocks of 16 "
        "(see csrc/kernels.h)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n_out"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul_backward", &realhf::silu_mul_backward_cpu,
        "(d_gate, d_up) of silu(gate) * up from the output's gradient, in one pass",
        py::arg("gate"), py::arg("up"), py::arg("grad_out"), py::arg("isa") = "",
        py::call_guard<py::gil_scoped_release>());
  m.def("tensor_pool_install", &realhf::tensor_pool_install,
        "Install realhf's pool for large CPU tensors as torch's CPU allocator (see "
        "csrc/tensor_pool.cpp); false if installed already",
        py::arg("reserve_bytes"), py::arg("min_bytes"));
  m.def("tensor_pool_trim", &realhf::tensor_pool_trim,
        "Give the pool's free pages back to the system; the bytes given back",
        py::call_guard<py::gil_scoped_release>());
  m.def("tensor_pool_stats", &realhf::tensor_pool_stats,
        "The pool's counters (empty where none is installed)");
}
