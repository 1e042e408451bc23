// Python bindings of mok-mxfp8's version and build facts.
#include "build_info.h"

#include "mok/core/pybind/build_info.h"
#include "register.h"

namespace mok::mxfp8::bindings {

void register_build_info(pybind11::module_& m) {
  m.def("version", [] { return build_info().version; }, "Version of this mok-mxfp8 build.");
  m.def(
      "build_info", [] { return mok::core::build_info_dict(build_info()); },
      "What this mok-mxfp8 build was compiled with: package, version, mok_core_version (the "
      "mok-core headers it was built against), cuda, cuda_architectures, "
      "cuda_compiler_version, cuda_runtime_version, cxx_compiler, build_type, backends.");
}

}  // namespace mok::mxfp8::bindings
