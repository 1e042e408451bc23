// What the MXFP8 expert kernels' entry points share: CUDA error checks, output stores, and the
// launch of an FP8 grouped GEMM (fp8_gemm.cuh) with its shared memory and grid.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fp8_gemm.cuh"
#include "mok/core/bf16.h"

namespace mok::mxfp8::kernels {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("mok-mxfp8: ") + what + ": " + cudaGetErrorString(err));
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

// Two bf16 bit patterns as one 32-bit store (low half first in memory).
__device__ inline void store_pair(std::uint16_t* p, std::uint16_t lo, std::uint16_t hi) {
  *reinterpret_cast<std::uint32_t*>(p) =
      static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

// Each output element rounded once to bf16, into a row-major [rows, n] array.
struct StoreBf16 {
  std::uint16_t* out;
  int n;

  __device__ void operator()(const gemm::Tile& tile, int consumer,
                             const gemm::Accumulators& acc) const {
    gemm::for_each_pair<gemm::kBlockN>(tile, consumer, n, [&](std::int64_t row, int col, int q) {
      store_pair(out + row * n + col, core::float_to_bf16(acc.d[q]),
                 core::float_to_bf16(acc.d[q + 1]));
    });
  }
};

// Each output element as the fp32 sum, into a row-major [rows, n] array.
struct StoreF32 {
  float* out;
  int n;

  __device__ void operator()(const gemm::Tile& tile, int consumer,
                             const gemm::Accumulators& acc) const {
    gemm::for_each_pair<gemm::kBlockN>(tile, consumer, n, [&](std::int64_t row, int col, int q) {
      *reinterpret_cast<float2*>(out + row * n + col) = make_float2(acc.d[q], acc.d[q + 1]);
    });
  }
};

// Launches one FP8 grouped GEMM on `stream` with at most `num_sms` CTAs.
template <gemm::BLoad kB, class Epilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b0, const CUtensorMap& map_b1,
            const tiles::Problem& p, const gemm::Scales& scales, const Epilogue& epilogue,
            int num_sms, cudaStream_t stream) {
  using R = gemm::Ring<gemm::kStages>;
  constexpr int kTileN = kB == gemm::BLoad::kPaired ? gemm::kBlockN / 2 : gemm::kBlockN;
  auto* kernel = gemm::fp8_grouped_gemm_kernel<kB, gemm::kStages, Epilogue>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSharedBytes),
        "setting the shared memory size");
  // No more CTAs than tiles can exist: every expert adds at most one partial row tile.
  const std::int64_t n_tiles = (p.n + kTileN - 1) / kTileN;
  const std::int64_t most =
      ((p.num_rows + tiles::kBlockM - 1) / tiles::kBlockM + p.num_experts) * n_tiles;
  const int grid =
      static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_sms, most)));
  kernel<<<grid, gemm::kThreads, R::kSharedBytes, stream>>>(map_a, map_b0, map_b1, p, scales,
                                                            epilogue);
  check(cudaGetLastError(), "launching an FP8 grouped GEMM");
}

}  // namespace mok::mxfp8::kernels
