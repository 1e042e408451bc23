// Python bindings of mok-core's version and build facts.
#include "build_info.h"

#include "mok/core/pybind/build_info.h"
#include "register.h"

namespace mok::core::bindings {

void register_build_info(pybind11::module_& m) {
  m.def("version", [] { return build_info().version; }, "Version of this mok-core build.");
  m.def(
      "build_info", [] { return build_info_dict(build_info()); },
      "What this mok-core build was compiled with: package, version, mok_core_version, cuda, "
      "cuda_architectures, cuda_compiler_version, cuda_runtime_version, cxx_compiler, "
      "build_type, backends.");
}

}  // namespace mok::core::bindings
