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
