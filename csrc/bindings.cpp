// Python bindings of realhf's CPU kernels: the extension module `realhf._C`.
// The GIL is released while a kernel runs so other Python threads keep going.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "realhf CPU kernels: packed GAE, flat-buffer interval copies, decode attention, inference RMSNorm and RoPE, vocabulary log-softmax";
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
        "row_logsumexp, row_softmax_grad) this CPU "
        "runs: 'avx512', 'avx2' or '' (none)");
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
}
