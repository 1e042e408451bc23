// The quantizer on the GPU, the arithmetic of format.h. A normal copy of 16-byte aligned rows
// runs quantize_rows_kernel (lanes share a block); a transposed copy of an aligned source
// quantize_tiled_kernel (a tile through shared memory); any other layout one thread per block.
//
// Threads walk the blocks so that neighbouring threads read neighbouring memory: when the
// source's columns are contiguous (a normal copy) a thread reads its 32 elements as one 64- or
// 128-byte run and the next thread the next run; when its rows are (a transposed copy) the
// thread index runs along rows, so a warp reads 32 consecutive elements per step.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "lanes.cuh"
#include "mok/mxfp8/quantize.h"

namespace mok::mxfp8 {
namespace {

template <SourceType kType>
__device__ std::uint32_t load_bits(const void* src, std::int64_t offset) {
  if constexpr (kType == SourceType::kBf16) {
    return static_cast<std::uint32_t>(static_cast<const std::uint16_t*>(src)[offset]) << 16;
  } else {
    return static_cast<const std::uint32_t*>(src)[offset];
  }
}

template <SourceType kType>
__global__ void quantize_kernel(QuantizeArgs a, bool rows_fastest, std::int64_t total) {
  const std::int64_t blocks = a.cols / kBlock;
  const void* src = reinterpret_cast<const void*>(a.src);
  auto* data = reinterpret_cast<std::uint8_t*>(a.data);
  auto* scales = reinterpret_cast<std::uint8_t*>(a.scales);
  for (std::int64_t flat = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       flat < total; flat += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t r, j, b;
    if (rows_fastest) {
      r = flat % a.rows;
      j = (flat / a.rows) % blocks;
      b = flat / (a.rows * blocks);
    } else {
      j = flat % blocks;
      r = (flat / blocks) % a.rows;
      b = flat / (blocks * a.rows);
    }
    const std::int64_t base = b * a.src_batch_stride + r * a.src_row_stride;
    const std::int64_t c0 = j * kBlock;
    std::uint8_t* out = data + (b * a.rows + r) * a.data_row_stride + c0;
    std::uint32_t v[kBlock];
    constexpr int kBytes = kType == SourceType::kBf16 ? 2 : 4;
    const auto* run = static_cast<const unsigned char*>(src) + (base + c0) * kBytes;
    if (!rows_fastest && reinterpret_cast<std::uintptr_t>(run) % 16 == 0) {
      // The block is one contiguous run: read it as 16-byte vectors (4 or 8 of them).
      const auto* run4 = reinterpret_cast<const uint4*>(run);
#pragma unroll
      for (int w = 0; w < kBlock * kBytes / 16; ++w) {
        const uint4 u = run4[w];
        const std::uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (kType == SourceType::kBf16) {  // two bf16, the lower address low
            v[8 * w + 2 * i] = words[i] << 16;
            v[8 * w + 2 * i + 1] = words[i] & 0xFFFF0000u;
          } else {
            v[4 * w + i] = words[i];
          }
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kBlock; ++i)
        v[i] = load_bits<kType>(src, base + (c0 + i) * a.src_col_stride);
    }
    alignas(16) std::uint8_t q[kBlock];  // stored as two 16-byte vectors below
    const std::uint8_t s = quantize_block(
        kBlock, a.rule, [&](int i) { return v[i]; }, [&](int i, std::uint8_t x) { q[i] = x; });
    if (reinterpret_cast<std::uintptr_t>(out) % 16 == 0) {
      const uint4* q4 = reinterpret_cast<const uint4*>(q);
      uint4* out4 = reinterpret_cast<uint4*>(out);
      out4[0] = q4[0];
      out4[1] = q4[1];
    } else {
#pragma unroll
      for (int i = 0; i < kBlock; ++i) out[i] = q[i];
    }
    scales[b * a.rows * blocks + r * a.scale_row_stride + j * a.scale_block_stride] = s;
  }
}

// The normal copy of a source whose rows are contiguous and 16-byte aligned: lanes share a
// block (4 lanes of 8 bf16 or 8 lanes of 4 fp32, one 16-byte load each), so a warp reads 512
// consecutive bytes and writes its blocks' bytes in 8- or 4-byte pieces side by side; the block's
// statistics are merged across its lanes with shuffles (an exact max and an and: the bytes are
// those of quantize_block).
template <SourceType kType>
__global__ void quantize_rows_kernel(QuantizeArgs a, std::int64_t total) {
  constexpr int kBytes = kType == SourceType::kBf16 ? 2 : 4;
  constexpr int kLanes = kBlock * kBytes / 16;  // lanes per block
  constexpr int kPer = kBlock / kLanes;         // elements per lane
  constexpr int kPerWarp = 32 / kLanes;         // blocks per warp step
  const int lane = threadIdx.x % 32, part = lane % kLanes;
  const std::int64_t blocks = a.cols / kBlock;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const auto* src = reinterpret_cast<const unsigned char*>(a.src);
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32;
       w * kPerWarp < total; w += warps) {  // uniform across the warp: every lane shuffles
    const std::int64_t flat = w * kPerWarp + lane / kLanes;
    const bool valid = flat < total;
    const std::int64_t j = flat % blocks, r = (flat / blocks) % a.rows,
                       b = flat / (blocks * a.rows);
    std::uint32_t v[kPer] = {};
    if (valid) {
      const std::int64_t at = b * a.src_batch_stride + r * a.src_row_stride + j * kBlock;
      const uint4 u = *reinterpret_cast<const uint4*>(src + at * kBytes + 16 * part);
      const std::uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (kType == SourceType::kBf16) {  // two bf16, the lower address low
          v[2 * i] = words[i] << 16;
          v[2 * i + 1] = words[i] & 0xFFFF0000u;
        } else {
          v[i] = words[i];
        }
      }
    }
    const BlockStats stats = kernels::lane_block_stats<kLanes>(v);
    if (!valid) continue;
    const int e = stats.exponent(a.rule);
    std::uint32_t packed[kPer / 4];
    kernels::lane_block_bytes(stats, e, v, packed);
    auto* out = reinterpret_cast<unsigned char*>(a.data) + (b * a.rows + r) * a.data_row_stride +
                j * kBlock + kPer * part;
    if constexpr (kPer == 8) {
      *reinterpret_cast<uint2*>(out) = make_uint2(packed[0], packed[1]);
    } else {
      *reinterpret_cast<std::uint32_t*>(out) = packed[0];
    }
    if (part == 0) {
      reinterpret_cast<std::uint8_t*>(
          a.scales)[b * a.rows * blocks + r * a.scale_row_stride + j * a.scale_block_stride] =
          stats.scale(e);
    }
  }
}

// A transposed copy (blocks along the source's rows) of a source whose other dimension is
// contiguous and 16-byte aligned: a CTA stages a tile of 32 source rows (one block of every
// output row it takes) x kTileRows output rows in shared memory, read as 16-byte vectors along
// the contiguous dimension; then a thread per output row quantizes its 32 elements (a column of
// the tile) and stores them as two 16-byte vectors. quantize_kernel reads the same blocks with a
// 2- or 4-byte load per element.
constexpr int kTileRows = 256;  // output rows per CTA (= threads)

template <SourceType kType>
__global__ void __launch_bounds__(kTileRows)
    quantize_tiled_kernel(QuantizeArgs a, std::int64_t row_tiles, std::int64_t tiles) {
  constexpr int kBytes = kType == SourceType::kBf16 ? 2 : 4;
  constexpr int kPerVec = 16 / kBytes;  // elements per 16-byte load
  using Bits = std::conditional_t<kType == SourceType::kBf16, std::uint16_t, std::uint32_t>;
  __shared__ alignas(16) Bits tile[kBlock][kTileRows];
  const std::int64_t blocks = a.cols / kBlock;
  const auto* src = reinterpret_cast<const unsigned char*>(a.src);
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const std::int64_t rt = t % row_tiles, j = (t / row_tiles) % blocks,
                       b = t / (row_tiles * blocks);
    const std::int64_t r0 = rt * kTileRows;
    const int valid = static_cast<int>(a.rows - r0 < kTileRows ? a.rows - r0 : kTileRows);
    // Element (r, c) of matrix b is at src[b * sbs + r * 1 + c * scs]: for block j the 32
    // columns c = 32 j + i are 32 runs of `valid` contiguous elements.
    constexpr int kVecs = kBlock * kTileRows / kPerVec;
    for (int v = threadIdx.x; v < kVecs; v += kTileRows) {
      const int i = v / (kTileRows / kPerVec), e = (v % (kTileRows / kPerVec)) * kPerVec;
      if (e < valid) {  // valid is a multiple of 8 (rows % 8 == 0 is checked at launch)
        const std::int64_t at =
            b * a.src_batch_stride + r0 + e + (j * kBlock + i) * a.src_col_stride;
        *reinterpret_cast<uint4*>(&tile[i][e]) = *reinterpret_cast<const uint4*>(src + at * kBytes);
      }
    }
    __syncthreads();
    const int r = threadIdx.x;
    if (r < valid) {
      std::uint32_t q[kBlock / 4] = {};
      const std::uint8_t s = quantize_block(
          kBlock, a.rule,
          [&](int i) {
            if constexpr (kType == SourceType::kBf16) {
              return static_cast<std::uint32_t>(tile[i][r]) << 16;
            } else {
              return static_cast<std::uint32_t>(tile[i][r]);
            }
          },
          [&](int i, std::uint8_t x) {
            q[i / 4] |= static_cast<std::uint32_t>(x) << (8 * (i % 4));
          });
      auto* out = reinterpret_cast<uint4*>(reinterpret_cast<std::uint8_t*>(a.data) +
                                           (b * a.rows + r0 + r) * a.data_row_stride + j * kBlock);
      out[0] = make_uint4(q[0], q[1], q[2], q[3]);
      out[1] = make_uint4(q[4], q[5], q[6], q[7]);
      reinterpret_cast<std::uint8_t*>(
          a.scales)[b * a.rows * blocks + (r0 + r) * a.scale_row_stride +
                    j * a.scale_block_stride] = s;
    }
    __syncthreads();  // the tile is refilled for the next one
  }
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("quantize: ") + what + " failed: " +
                             cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

}  // namespace

void quantize_cuda(const QuantizeArgs& args, std::uintptr_t stream) {
  QuantizeArgs a = args;
  if (a.data_row_stride == 0) a.data_row_stride = a.cols;
  const std::int64_t total = a.batch * a.rows * (a.cols / kBlock);
  if (total == 0) return;
  const bool rows_fastest = a.src_col_stride != 1;
  constexpr int kThreads = 256;
  const std::int64_t wanted = (total + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(wanted < 65535 * 16 ? wanted : 65535 * 16);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const std::int64_t bytes = a.src_type == SourceType::kBf16 ? 2 : 4;
  const bool rows_aligned = a.src % 16 == 0 && (a.src_batch_stride * bytes) % 16 == 0 &&
                            (a.src_row_stride * bytes) % 16 == 0 && a.data % 8 == 0 &&
                            a.data_row_stride % 8 == 0;
  if (!rows_fastest && rows_aligned) {
    const std::int64_t warps = (total * bytes * kBlock / 16 + 31) / 32;  // a lane per 16 bytes
    const std::int64_t ctas = (warps + kThreads / 32 - 1) / (kThreads / 32);
    const unsigned g = static_cast<unsigned>(ctas < 65535 * 16 ? ctas : 65535 * 16);
    if (a.src_type == SourceType::kBf16) {
      quantize_rows_kernel<SourceType::kBf16><<<g, kThreads, 0, s>>>(a, total);
    } else {
      quantize_rows_kernel<SourceType::kFp32><<<g, kThreads, 0, s>>>(a, total);
    }
    check_cuda(cudaGetLastError(), "quantize_rows_kernel launch");
    return;
  }
  // A transposed copy whose source rows are contiguous (output rows run along them) and whose
  // vectors and output rows are 16-byte aligned: the tiled kernel.
  const bool tiled = rows_fastest && a.src_row_stride == 1 && a.src % 16 == 0 &&
                     (a.src_batch_stride * bytes) % 16 == 0 &&
                     (a.src_col_stride * bytes) % 16 == 0 && a.rows % 8 == 0 && a.data % 16 == 0 &&
                     a.data_row_stride % 16 == 0;
  if (tiled) {
    const std::int64_t row_tiles = (a.rows + kTileRows - 1) / kTileRows;
    const std::int64_t tiles = a.batch * row_tiles * (a.cols / kBlock);
    const unsigned g = static_cast<unsigned>(tiles < 65535 * 16 ? tiles : 65535 * 16);
    if (a.src_type == SourceType::kBf16) {
      quantize_tiled_kernel<SourceType::kBf16><<<g, kTileRows, 0, s>>>(a, row_tiles, tiles);
    } else {
      quantize_tiled_kernel<SourceType::kFp32><<<g, kTileRows, 0, s>>>(a, row_tiles, tiles);
    }
    check_cuda(cudaGetLastError(), "quantize_tiled_kernel launch");
    return;
  }
  if (a.src_type == SourceType::kBf16) {
    quantize_kernel<SourceType::kBf16><<<grid, kThreads, 0, s>>>(a, rows_fastest, total);
  } else {
    quantize_kernel<SourceType::kFp32><<<grid, kThreads, 0, s>>>(a, rows_fastest, total);
  }
  check_cuda(cudaGetLastError(), "quantize_kernel launch");
}

}  // namespace mok::mxfp8
