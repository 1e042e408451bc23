// CUDA device queries: cuda/device_query.cu with CUDA, src/device_query_no_cuda.cpp without.
#pragma once

#include <cstdint>
#include <string>

namespace mok::core {

// The properties the planners size their work by.
struct CudaDeviceProperties {
  std::string name;
  int major = 0;  // compute capability
  int minor = 0;
  int multiprocessor_count = 0;
  std::int64_t l2_cache_bytes = 0;
  std::int64_t shared_memory_per_block_optin = 0;  // bytes one block may opt in to
  std::int64_t total_memory = 0;                   // bytes of device memory
};

// Number of visible CUDA devices; 0 when there is no driver, no device or no CUDA build.
// Never throws. With CUDA it initializes the driver (do not call it before a fork that will use
// CUDA in the child).
int cuda_device_count() noexcept;

// Properties of device `index`. Throws std::invalid_argument when index is not in
// [0, cuda_device_count()), std::runtime_error when built without CUDA or the query fails.
CudaDeviceProperties cuda_device_properties(int index);

// Version of the CUDA runtime linked into this module (e.g. 13000); 0 without CUDA.
int cuda_runtime_version() noexcept;

}  // namespace mok::core
