// Python bindings of mok-bf16's version and build facts.
#include "build_info.h"

#include "mok/core/pybind/build_info.h"
#include "register.h"

namespace mok::bf16::bindings {

void register_build_info(pybind11::module_& m) {
  m.def("version", [] { return build_info().version; }, "Version of this mok-bf16 build.");
  m.def(
      "build_info", [] { return mok::core::build_info_dict(build_info()); },
      "What this mok-bf16 build was compiled with: package, version, mok_core_version (the "
      "mok-core headers it was built against), cuda, cuda_architectures, "
      "cuda_compiler_version, cuda_runtime_version, cxx_compiler, build_type, backends.");
}

}  // namespace mok::bf16::bindings
