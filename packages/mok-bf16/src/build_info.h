// mok-bf16's build facts (compiled into mok_bf16._C, so not a public header).
#pragma once

#include "mok/core/build_info.h"

namespace mok::bf16 {

mok::core::BuildInfo build_info();

#if MOK_WITH_CUDA
// Version of the CUDA runtime linked into this module (e.g. 13000); in cuda/.
int cuda_runtime_version() noexcept;
#endif

}  // namespace mok::bf16
