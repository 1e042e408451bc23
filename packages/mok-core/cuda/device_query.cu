// CUDA device queries through the runtime API (no kernel): safe without a GPU or a driver.
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#include "device_query.h"

namespace mok::core {

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver, no device, or a driver older than the runtime. Clear the error so that it
    // does not surface from a later, unrelated runtime call.
    cudaGetLastError();
    return 0;
  }
  return count;
}

CudaDeviceProperties cuda_device_properties(int index) {
  const int count = cuda_device_count();
  if (index < 0 || index >= count) {
    throw std::invalid_argument("cuda_device_properties: index must be in [0, " +
                                std::to_string(count) + ") (" + std::to_string(count) +
                                " CUDA devices visible), got " + std::to_string(index));
  }
  cudaDeviceProp prop{};
  const cudaError_t status = cudaGetDeviceProperties(&prop, index);
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("cuda_device_properties: cudaGetDeviceProperties(" +
                             std::to_string(index) + ") failed: " + cudaGetErrorName(status) +
                             ": " + cudaGetErrorString(status));
  }
  CudaDeviceProperties props;
  props.name = prop.name;
  props.major = prop.major;
  props.minor = prop.minor;
  props.multiprocessor_count = prop.multiProcessorCount;
  props.l2_cache_bytes = prop.l2CacheSize;
  props.shared_memory_per_block_optin = static_cast<std::int64_t>(prop.sharedMemPerBlockOptin);
  props.total_memory = static_cast<std::int64_t>(prop.totalGlobalMem);
  return props;
}

int cuda_runtime_version() noexcept {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return version;
}

}  // namespace mok::core
