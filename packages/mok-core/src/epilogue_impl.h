// Host entry points of the combine epilogue (docs/core-runtime.md "Epilogue"): argument checks
// and the CPU loop in src/epilogue.cpp, the CUDA launch in cuda/epilogue.cu.
#pragma once

#include <cstdint>
#include <string_view>

#include "mok/core/epilogue.h"  // CombineArgs

namespace mok::core {

// Checked call: std::invalid_argument for a bad argument, std::runtime_error for "cuda"
// without CUDA or a failed launch.
void combine(std::string_view device, const CombineArgs& args, std::uintptr_t stream);

void combine_cpu(const CombineArgs& args);
#if MOK_WITH_CUDA
void combine_cuda(const CombineArgs& args, std::uintptr_t stream);
// The error words' 16-byte copy to the mirror (CombineArgs::error_mirror) where no kernel runs.
void publish_error_cuda(const CombineArgs& args, std::uintptr_t stream);
#endif

}  // namespace mok::core
