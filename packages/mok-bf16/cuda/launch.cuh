// What the expert kernels' entry points share: output stores, CUDA error checks, and the
// launch of a grouped GEMM (grouped_gemm.cuh) with its shared memory and grid.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "grouped_gemm.cuh"
#include "mok/core/bf16.h"

namespace mok::bf16::kernels {

inline constexpr int kStages = 4;  // the GEMMs' shared-memory ring (4 x 48 KiB)

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("mok-bf16: ") + what + ": " + cudaGetErrorString(err));
  }
}

inline int device_sms() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "reading the SM count");
  return sms;
}

// Zeroes the rows of a row-major array (row_bytes a multiple of 4) that no segment covers, the
// segments as the GEMMs' tile walk reads them (offsets clamped to [0, M], a decreasing end makes
// a segment empty): with non-decreasing offsets the rows before offsets[0] and from offsets[El]
// on; otherwise each row is checked against every segment. A warp per row; nothing is read on
// the host, so fresh outputs need no fill pass. (Internal linkage: every .cu has its copy.)
namespace {
__global__ void zero_uncovered_rows_kernel(unsigned char* data, std::int64_t row_bytes,
                                           const std::int64_t* offsets, int num_experts,
                                           std::int64_t num_rows) {
  __shared__ std::int64_t seg_lo[gemm::kMaxExperts], seg_hi[gemm::kMaxExperts];
  __shared__ int sorted;
  if (threadIdx.x == 0) sorted = 1;
  __syncthreads();
  const auto clamp = [&](std::int64_t r) { return r < 0 ? 0 : (r > num_rows ? num_rows : r); };
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const std::int64_t lo = clamp(offsets[e]), hi = clamp(offsets[e + 1]);
    if (hi < lo || (e > 0 && lo < clamp(offsets[e - 1]))) sorted = 0;
    seg_lo[e] = lo;
    seg_hi[e] = hi < lo ? lo : hi;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t r = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
       r < num_rows; r += warps) {
    bool covered;
    if (sorted) {
      covered = r >= seg_lo[0] && r < seg_hi[num_experts - 1];
    } else {
      bool mine = false;
      for (int e = lane; e < num_experts; e += 32) mine |= r >= seg_lo[e] && r < seg_hi[e];
      covered = __any_sync(0xFFFFFFFFu, mine);
    }
    if (covered) continue;
    unsigned char* row = data + r * row_bytes;
    if (row_bytes % 16 == 0) {
      for (std::int64_t i = 16 * lane; i < row_bytes; i += 16 * 32)
        *reinterpret_cast<uint4*>(row + i) = make_uint4(0, 0, 0, 0);
    } else {
      for (std::int64_t i = 4 * lane; i < row_bytes; i += 4 * 32)
        *reinterpret_cast<std::uint32_t*>(row + i) = 0;
    }
  }
}
}  // namespace

// zero_uncovered_rows_kernel on `stream` for an array (skipped when null or empty).
inline void zero_uncovered_rows(std::uintptr_t data, std::int64_t row_bytes,
                                const std::int64_t* offsets, int num_experts, std::int64_t num_rows,
                                int num_sms, cudaStream_t stream) {
  if (data == 0 || row_bytes == 0 || num_rows == 0) return;
  const std::int64_t blocks = std::min<std::int64_t>(4 * num_sms, (num_rows + 7) / 8);
  zero_uncovered_rows_kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(
      reinterpret_cast<unsigned char*>(data), row_bytes, offsets, num_experts, num_rows);
  check(cudaGetLastError(), "launching the zeroing of uncovered rows");
}

// Each output element rounded once to bf16, into a row-major [rows, n] array; deferred
// (grouped_gemm.cuh: stored while the next tile's first k-blocks run).
struct StoreBf16 {
  std::uint16_t* out;
  int n;

  static constexpr bool kDeferred = true;
  template <int kChunk>
  __device__ void store(const gemm::Tile& tile, int consumer, const gemm::PackedBf16& p) const {
    gemm::for_each_pair_in_chunk<kChunk, gemm::kMmaN>(
        tile, consumer, n, [&](std::int64_t row, int col, int q) {
          *reinterpret_cast<std::uint32_t*>(out + row * n + col) = p.w[q / 2];
        });
  }
};

// Each output element as the fp32 sum, into a row-major [rows, n] array.
struct StoreF32 {
  float* out;
  int n;

  __device__ void operator()(const gemm::Tile& tile, int consumer,
                             const gemm::Accumulators& acc) const {
    gemm::for_each_pair<gemm::kMmaN>(tile, consumer, n, [&](std::int64_t row, int col, int q) {
      *reinterpret_cast<float2*>(out + row * n + col) = make_float2(acc.d[q], acc.d[q + 1]);
    });
  }
};

// Launches one grouped GEMM on `stream` with at most `num_sms` CTAs.
template <gemm::BLoad kB, class Epilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b0, const CUtensorMap& map_b1,
            const gemm::Problem& p, const Epilogue& epilogue, int num_sms, cudaStream_t stream) {
  using R = gemm::Ring<kStages>;
  constexpr int kBlockN = kB == gemm::BLoad::kPaired ? gemm::kMmaN / 2 : gemm::kMmaN;
  auto* kernel = gemm::grouped_gemm_kernel<kB, kStages, Epilogue>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSharedBytes),
        "setting the shared memory size");
  // No more CTAs than tiles can exist: every expert adds at most one partial row tile.
  const std::int64_t n_tiles = (p.n + kBlockN - 1) / kBlockN;
  const std::int64_t most =
      ((p.num_rows + gemm::kBlockM - 1) / gemm::kBlockM + p.num_experts) * n_tiles;
  const int grid =
      static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_sms, most)));
  kernel<<<grid, gemm::kThreads, R::kSharedBytes, stream>>>(map_a, map_b0, map_b1, p, epilogue);
  check(cudaGetLastError(), "launching a grouped GEMM");
}

}  // namespace mok::bf16::kernels
