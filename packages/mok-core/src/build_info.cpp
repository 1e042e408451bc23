// mok-core's build facts, from the header CMake generates for this build.
#include "build_info.h"

#include "device_query.h"
#include "mok/core/version.h"
#include "mok_build_config.h"

namespace mok::core {

BuildInfo build_info() {
  BuildInfo info;
  info.package = MOK_BUILD_PACKAGE;
  info.version = MOK_BUILD_VERSION;
  info.mok_core_version = MOK_CORE_VERSION_STRING;
  info.cuda = MOK_WITH_CUDA != 0;
  info.cuda_architectures = split_cmake_list(MOK_BUILD_CUDA_ARCHITECTURES);
  info.cuda_compiler_version = MOK_BUILD_CUDA_COMPILER_VERSION;
  info.cuda_runtime_version = cuda_runtime_version();
  info.cxx_compiler = MOK_BUILD_CXX_COMPILER;
  info.build_type = MOK_BUILD_TYPE;
  return info;
}

}  // namespace mok::core
