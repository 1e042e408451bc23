// The quantize entry point's host side: argument checks, the device dispatch, the CPU loops.
#include "mok/mxfp8/quantize.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "mok/core/threads.h"

namespace mok::mxfp8 {
namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw std::invalid_argument("quantize: " + what);
}

std::string got(std::int64_t v) { return ", got " + std::to_string(v); }

void check(const QuantizeArgs& a) {
  if (a.batch < 0) invalid("batch must be >= 0" + got(a.batch));
  if (a.rows < 0) invalid("rows must be >= 0" + got(a.rows));
  if (a.cols < 0 || a.cols % kBlock != 0) {
    invalid("cols must be a non-negative multiple of 32 (the MX block)" + got(a.cols));
  }
  if (a.src_type != SourceType::kBf16 && a.src_type != SourceType::kFp32) {
    invalid("src_type must be bf16 (0) or fp32 (1)" + got(static_cast<int>(a.src_type)));
  }
  if (a.rule != ScaleRule::kRceil && a.rule != ScaleRule::kFloor) {
    invalid("rule must be RCEIL (0) or FLOOR (1)" + got(static_cast<int>(a.rule)));
  }
  if (a.num_threads < 1 || a.num_threads > kMaxThreads) {
    invalid("num_threads must be in [1, " + std::to_string(kMaxThreads) + "]" + got(a.num_threads));
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 8;
  if (a.batch != 0 && a.rows != 0 && a.cols != 0 &&
      (a.rows > kMax / a.cols || a.batch > kMax / (a.rows * a.cols))) {
    invalid("the arrays are too large");
  }
  const std::int64_t n = a.batch * a.rows * a.cols;
  if (n == 0) return;
  const std::int64_t elem = a.src_type == SourceType::kBf16 ? 2 : 4;
  if (a.src == 0) invalid("src must not be 0 (a null pointer)");
  if (a.src % elem != 0) invalid("src must be aligned to its element size" + got(a.src));
  if (a.data == 0) invalid("data must not be 0 (a null pointer)");
  if (a.scales == 0) invalid("scales must not be 0 (a null pointer)");
  const std::int64_t blocks = a.cols / kBlock;
  const std::int64_t data_rows = a.data_row_stride != 0 ? a.data_row_stride : a.cols;
  if (data_rows < a.cols) {
    invalid("data_row_stride must be 0 or >= cols = " + std::to_string(a.cols) +
            got(a.data_row_stride));
  }
  if (data_rows != a.cols && a.batch != 1) {
    invalid("a data_row_stride other than cols needs batch 1" + got(a.batch));
  }
  // The scale strides must place every (r, j) of a matrix at a distinct index below rows*blocks
  // (or, in rows with their scales, after each row's bytes).
  const bool row_major = a.scale_block_stride == 1 && a.scale_row_stride == blocks;
  const bool block_major = a.scale_row_stride == 1 && a.scale_block_stride == a.rows;
  const bool with_rows = data_rows != a.cols && a.scale_block_stride == 1 &&
                         a.scale_row_stride == data_rows && data_rows >= a.cols + blocks;
  if (!row_major && !block_major && !with_rows) {
    invalid("scale strides must be row-major (row " + std::to_string(blocks) +
            ", block 1), block-major (row 1, block " + std::to_string(a.rows) +
            ") or with the rows (row data_row_stride, block 1), got (row " +
            std::to_string(a.scale_row_stride) + ", block " + std::to_string(a.scale_block_stride) +
            ")");
  }
  if (a.src_row_stride < 0 || a.src_col_stride < 0 || a.src_batch_stride < 0) {
    invalid("source strides must be >= 0");
  }
}

std::uint32_t load_bits(const QuantizeArgs& a, std::int64_t offset) {
  if (a.src_type == SourceType::kBf16) {
    std::uint16_t v;
    std::memcpy(&v, reinterpret_cast<const unsigned char*>(a.src) + 2 * offset, sizeof v);
    return static_cast<std::uint32_t>(v) << 16;
  }
  std::uint32_t v;
  std::memcpy(&v, reinterpret_cast<const unsigned char*>(a.src) + 4 * offset, sizeof v);
  return v;
}

// Blocks [begin, end) of the flat (b, r, j) index.
void quantize_range(const QuantizeArgs& a, std::int64_t begin, std::int64_t end) {
  const std::int64_t blocks = a.cols / kBlock;
  auto* data = reinterpret_cast<std::uint8_t*>(a.data);
  auto* scales = reinterpret_cast<std::uint8_t*>(a.scales);
  for (std::int64_t flat = begin; flat < end; ++flat) {
    const std::int64_t j = flat % blocks;
    const std::int64_t r = (flat / blocks) % a.rows;
    const std::int64_t b = flat / (blocks * a.rows);
    const std::int64_t base = b * a.src_batch_stride + r * a.src_row_stride;
    const std::int64_t c0 = j * kBlock;
    const std::int64_t data_rows = a.data_row_stride != 0 ? a.data_row_stride : a.cols;
    std::uint8_t* out = data + (b * a.rows + r) * data_rows + c0;
    const std::uint8_t s = quantize_block(
        kBlock, a.rule, [&](int i) { return load_bits(a, base + (c0 + i) * a.src_col_stride); },
        [&](int i, std::uint8_t v) { out[i] = v; });
    scales[b * a.rows * blocks + r * a.scale_row_stride + j * a.scale_block_stride] = s;
  }
}

}  // namespace

void quantize_cpu(const QuantizeArgs& a) {
  const std::int64_t total = a.batch * a.rows * (a.cols / kBlock);
  // at least 64 blocks per thread: fewer are not worth a thread
  const std::int64_t workers = std::max<std::int64_t>(1, std::min(a.num_threads, total / 64));
  core::parallel_ranges(total, workers, [&a](std::int64_t begin, std::int64_t end) {
    quantize_range(a, begin, end);
  });
}

void quantize(const std::string& device, const QuantizeArgs& args, std::uintptr_t stream) {
  if (device != "cpu" && device != "cuda") {
    invalid("device must be \"cpu\" or \"cuda\", got \"" + device + "\"");
  }
  check(args);
  if (args.batch * args.rows * args.cols == 0) return;
  if (device == "cpu") {
    quantize_cpu(args);
    return;
  }
#if MOK_WITH_CUDA
  quantize_cuda(args, stream);
#else
  (void)stream;
  throw std::runtime_error(
      "quantize: device=\"cuda\" but mok-mxfp8 was built without CUDA (MOK_CUDA=OFF, or no nvcc "
      "at build time); reinstall it with nvcc on PATH");
#endif
}

}  // namespace mok::mxfp8
