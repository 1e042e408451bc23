// CUDA device queries of a build without CUDA: no devices, and a clear error on any query.
#include <stdexcept>

#include "device_query.h"

namespace mok::core {

int cuda_device_count() noexcept { return 0; }

CudaDeviceProperties cuda_device_properties(int /*index*/) {
  throw std::runtime_error(
      "mok-core was built without CUDA (MOK_CUDA=OFF, or no nvcc at build time), so it cannot "
      "query CUDA devices; reinstall it with nvcc on PATH (MOK_CUDA=ON makes a missing nvcc an "
      "error)");
}

int cuda_runtime_version() noexcept { return 0; }

}  // namespace mok::core
