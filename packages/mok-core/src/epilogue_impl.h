// Host entry points of the combine epilogue (docs/core-runtime.md "Epilogue"): argument checks
// and the CPU loop in src/epilogue.cpp, the CUDA launch in cuda/epilogue.cu.
#pragma once

#include <cstdint>
#include <string_view>

namespace mok::core {

struct CombineArgs {
  std::uintptr_t out = 0;      // bf16 [T, H]
  std::uintptr_t base = 0;     // bf16 [T, H], or 0: none
  std::uintptr_t rows = 0;     // bf16 [T*K, H], or [num_rows, H] with a row index
  std::uintptr_t weights = 0;  // fp32 [T*K], or 0: all ones
  std::int64_t num_tokens = 0;
  std::int64_t topk = 0;
  std::int64_t hidden = 0;
  std::uintptr_t row_index = 0;  // int32 [T*K]: each route's row of `rows`, or 0: row t*K + k
  std::int64_t num_rows = 0;     // rows of `rows` (with a row index)
};

// Checked call: std::invalid_argument for a bad argument, std::runtime_error for "cuda"
// without CUDA or a failed launch.
void combine(std::string_view device, const CombineArgs& args, std::uintptr_t stream);

void combine_cpu(const CombineArgs& args);
#if MOK_WITH_CUDA
void combine_cuda(const CombineArgs& args, std::uintptr_t stream);
#endif

}  // namespace mok::core
