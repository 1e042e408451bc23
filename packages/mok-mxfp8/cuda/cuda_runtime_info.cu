// The CUDA runtime this module links (statically): each mok package carries its own copy.
#include <cuda_runtime_api.h>

#include "build_info.h"

namespace mok::mxfp8 {

int cuda_runtime_version() noexcept {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) {
    cudaGetLastError();  // leave no error behind for a later, unrelated call
    return 0;
  }
  return version;
}

}  // namespace mok::mxfp8
