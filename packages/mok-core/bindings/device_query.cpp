// Python bindings of the CUDA device queries.
#include "device_query.h"

#include "register.h"

namespace mok::core::bindings {

void register_device_query(pybind11::module_& m) {
  namespace py = pybind11;
  // The first call initializes the CUDA driver, which can take a while: let other threads run.
  m.def("cuda_device_count", &cuda_device_count, py::call_guard<py::gil_scoped_release>(),
        "Number of visible CUDA devices; 0 without a driver, a device or a CUDA build. Never "
        "raises.");
  m.def(
      "cuda_device_properties",
      [](int index) {
        const CudaDeviceProperties p = cuda_device_properties(index);
        py::dict d;
        d["name"] = p.name;
        d["major"] = p.major;
        d["minor"] = p.minor;
        d["multiprocessor_count"] = p.multiprocessor_count;
        d["l2_cache_bytes"] = p.l2_cache_bytes;
        d["shared_memory_per_block_optin"] = p.shared_memory_per_block_optin;
        d["total_memory"] = p.total_memory;
        return d;
      },
      py::arg("index"),
      "Properties of CUDA device `index` as a dict. Raises ValueError when index is out of "
      "range, RuntimeError when mok-core was built without CUDA.");
}

}  // namespace mok::core::bindings
