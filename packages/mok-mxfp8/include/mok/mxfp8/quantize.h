// The quantize entry point: a batch of matrices to MXFP8, blocks of 32 along one dimension.
#pragma once

#include <cstdint>
#include <string>

#include "mok/mxfp8/format.h"

namespace mok::mxfp8 {

enum class SourceType : int { kBf16 = 0, kFp32 = 1 };

inline constexpr std::int64_t kMaxThreads = 1024;

// Quantizes `batch` matrices A[b] of rows x cols, read at src + (b * src_batch_stride +
// r * src_row_stride + c * src_col_stride) elements, in blocks of 32 along cols. Writes the
// E4M3 bytes row-major to data[b][r][c] (batch-major; rows data_row_stride bytes apart, 0: cols)
// and the E8M0 scale of block (r, j) to scales[b * rows * (cols/32) + r * scale_row_stride + j *
// scale_block_stride]. A transposed copy is the same call with the roles of the strides swapped.
// MXFP8 rows as the layer's activations travel (cols bytes, then the row's cols/32 scales) are
// batch 1, data_row_stride = scale_row_stride = the row's bytes, scales = data + cols.
struct QuantizeArgs {
  std::uintptr_t src = 0;
  SourceType src_type = SourceType::kBf16;
  std::int64_t batch = 0;
  std::int64_t rows = 0;
  std::int64_t cols = 0;  // a multiple of 32
  std::int64_t src_batch_stride = 0;
  std::int64_t src_row_stride = 0;
  std::int64_t src_col_stride = 0;
  std::uintptr_t data = 0;           // uint8 [batch, rows, cols]
  std::int64_t data_row_stride = 0;  // bytes between data's rows (0: cols); != cols: batch 1
  std::uintptr_t scales = 0;  // uint8 [batch, rows * cols / 32], laid out by the strides below
  std::int64_t scale_row_stride = 0;
  std::int64_t scale_block_stride = 0;
  ScaleRule rule = ScaleRule::kRceil;
  std::int64_t num_threads = 1;  // CPU only; the bytes do not depend on it
};

// device: "cpu" or "cuda" (stream: a cudaStream_t as an integer). Raises std::invalid_argument
// naming a bad argument; "cuda" in a build without CUDA raises std::runtime_error.
void quantize(const std::string& device, const QuantizeArgs& args, std::uintptr_t stream);

void quantize_cpu(const QuantizeArgs& args);
#if MOK_WITH_CUDA
void quantize_cuda(const QuantizeArgs& args, std::uintptr_t stream);
#endif

}  // namespace mok::mxfp8
