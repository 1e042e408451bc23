// mok-bf16's build facts, from the header CMake generates for this build.
#include "build_info.h"

#include "mok/bf16/version.h"
#include "mok/core/version.h"
#include "mok_build_config.h"

namespace mok::bf16 {

mok::core::BuildInfo build_info() {
  mok::core::BuildInfo info;
  info.package = MOK_BUILD_PACKAGE;
  info.version = MOK_BF16_VERSION_STRING;
  // The headers seen at compile time: kernels and the schedule they read must agree on layout.
  info.mok_core_version = MOK_CORE_VERSION_STRING;
  info.cuda = MOK_WITH_CUDA != 0;
  info.cuda_architectures = mok::core::split_cmake_list(MOK_BUILD_CUDA_ARCHITECTURES);
  info.cuda_compiler_version = MOK_BUILD_CUDA_COMPILER_VERSION;
#if MOK_WITH_CUDA
  info.cuda_runtime_version = cuda_runtime_version();
#endif
  info.cxx_compiler = MOK_BUILD_CXX_COMPILER;
  info.build_type = MOK_BUILD_TYPE;
  return info;
}

}  // namespace mok::bf16
