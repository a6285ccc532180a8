// Python bindings of realhf's CUDA kernels: the extension module `realhf._C_cuda`.
// Kept in a .cpp file (compiled by the host compiler) so pybind11 never goes through nvcc.
#include "kernels_cuda.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "realhf CUDA kernels: packed GAE and flat-buffer interval copies";
  namespace py = pybind11;
  m.def("gae_packed", &realhf::gae_packed_cuda, py::arg("rewards"), py::arg("values"),
        py::arg("cu_seqlens"), py::arg("bootstrap"), py::arg("gamma"), py::arg("lam"));
  m.def("slice_intervals", &realhf::slice_intervals_cuda, py::arg("src"), py::arg("intervals"),
        py::arg("out") = py::none());
  m.def("set_intervals", &realhf::set_intervals_cuda, py::arg("src"), py::arg("dst"),
        py::arg("intervals"));
}
