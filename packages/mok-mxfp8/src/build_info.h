// mok-mxfp8's build facts (compiled into mok_mxfp8._C, so not a public header).
#pragma once

#include "mok/core/build_info.h"

namespace mok::mxfp8 {

mok::core::BuildInfo build_info();

#if MOK_WITH_CUDA
// Version of the CUDA runtime linked into this module (e.g. 13000); in cuda/.
int cuda_runtime_version() noexcept;
#endif

}  // namespace mok::mxfp8
