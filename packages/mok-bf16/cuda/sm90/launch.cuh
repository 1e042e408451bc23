// What the expert kernels' entry points share: output stores, CUDA error checks, and the
// launch of a grouped GEMM (grouped_gemm.cuh) with its shared memory and grid.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
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

// Host state kept per device (kernel attributes set, SM counts read): devices 0 .. 63.
inline constexpr int kTrackedDevices = 64;

inline int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// A value of the current device read from the driver once per tracked device (`known`: the
// caller's cache; read(device) gives it, and a value <= 0, none read, is not kept).
template <class T, class Read>
T read_once_per_device(std::atomic<T> (&known)[kTrackedDevices], const Read& read) {
  const int device = current_device();
  const bool tracked = device >= 0 && device < kTrackedDevices;
  if (tracked) {
    if (const T value = known[device].load(std::memory_order_relaxed); value > 0) return value;
  }
  const T value = read(device);
  if (tracked && value > 0) known[device].store(value, std::memory_order_relaxed);
  return value;
}

// The current device's peak memory bandwidth in bytes per second (twice the memory clock times
// the bus width, as the driver reports them); 0 where it reports none.
inline double device_memory_bandwidth() {
  static std::atomic<double> known[kTrackedDevices];
  return read_once_per_device(known, [](int device) {
    int khz = 0, bits = 0;
    if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());  // not sticky: clear it
      return 0.0;
    }
    return 2.0 * 1e3 * khz * (bits / 8.0);
  });
}

// The current device's SM count, read from the driver once per device.
inline int device_sms() {
  static std::atomic<int> known[kTrackedDevices];
  return read_once_per_device(known, [](int device) {
    int sms = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
          "reading the SM count");
    return sms;
  });
}

// Lets `kernel` use `bytes` of dynamic shared memory on the current device; the driver call is
// made once per kernel and device (each kernel has its own instantiation, so its own flags).
// A launch configuration in clusters of two CTAs along x (the attribute lives in the object, which
// the configuration points to: not copied).
struct PairLaunch {
  cudaLaunchAttribute cluster{};
  cudaLaunchConfig_t config{};

  PairLaunch(unsigned grid, unsigned threads, std::size_t shared_bytes, cudaStream_t stream) {
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = &cluster;
    config.numAttrs = 1;
  }
  PairLaunch(const PairLaunch&) = delete;
  PairLaunch& operator=(const PairLaunch&) = delete;
};

template <auto kKernel>
void allow_shared_bytes(int bytes) {
  static std::atomic<bool> done[kTrackedDevices];
  const int device = current_device();
  const bool tracked = device >= 0 && device < kTrackedDevices;
  if (tracked && done[device].load(std::memory_order_acquire)) return;
  check(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
        "setting the shared memory size");
  if (tracked) done[device].store(true, std::memory_order_release);
}

// Row-major arrays whose rows outside every segment a call zeroes (row_bytes a multiple of 4;
// null or empty ones are skipped).
struct ZeroTarget {
  std::uintptr_t data;
  std::int64_t row_bytes;
};
inline constexpr int kMaxZeroTargets = 4;
struct ZeroTargets {
  unsigned char* data[kMaxZeroTargets];
  std::int64_t row_bytes[kMaxZeroTargets];
  int count;
};

// Zeroes the rows that no segment covers in every target array, the segments as the GEMMs' tile
// walk reads them (offsets clamped to [0, M], a decreasing end makes a segment empty): with
// non-decreasing offsets the rows before offsets[0] and from offsets[El] on; otherwise each row
// is checked against every segment. A warp per row, each row checked once for all the targets;
// nothing is read on the host, so fresh outputs need no fill pass. (Internal linkage: every .cu
// has its copy.)
namespace {
__global__ void zero_uncovered_rows_kernel(ZeroTargets targets, const std::int64_t* offsets,
                                           int num_experts, std::int64_t num_rows) {
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
    for (int k = 0; k < targets.count; ++k) {
      const std::int64_t row_bytes = targets.row_bytes[k];
      unsigned char* row = targets.data[k] + r * row_bytes;
      if (row_bytes % 16 == 0) {
        for (std::int64_t i = 16 * lane; i < row_bytes; i += 16 * 32)
          *reinterpret_cast<uint4*>(row + i) = make_uint4(0, 0, 0, 0);
      } else {
        for (std::int64_t i = 4 * lane; i < row_bytes; i += 4 * 32)
          *reinterpret_cast<std::uint32_t*>(row + i) = 0;
      }
    }
  }
}
}  // namespace

// zero_uncovered_rows_kernel on `stream` for up to kMaxZeroTargets arrays: one launch for all.
inline void zero_uncovered_rows(std::initializer_list<ZeroTarget> arrays,
                                const std::int64_t* offsets, int num_experts, std::int64_t num_rows,
                                int num_sms, cudaStream_t stream) {
  ZeroTargets targets{};
  for (const ZeroTarget& t : arrays) {
    if (t.data == 0 || t.row_bytes == 0) continue;
    if (targets.count == kMaxZeroTargets) throw std::logic_error("mok-bf16: too many zero targets");
    targets.data[targets.count] = reinterpret_cast<unsigned char*>(t.data);
    targets.row_bytes[targets.count++] = t.row_bytes;
  }
  if (targets.count == 0 || num_rows == 0) return;
  const std::int64_t blocks = std::min<std::int64_t>(4 * num_sms, (num_rows + 7) / 8);
  zero_uncovered_rows_kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(targets, offsets,
                                                                           num_experts, num_rows);
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
    gemm::for_each_vector_in_chunk<kChunk>(p, [&](int, int r, int j, const uint4& v) {
      const std::int64_t row = tile.row0 + 64 * consumer + r;
      const int col = tile.col0 + 8 * j;
      if (row < tile.row_end && col < n) *reinterpret_cast<uint4*>(out + row * n + col) = v;
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

// Launches one grouped GEMM on `stream` with at most `num_sms` CTAs; kGatherA: A's rows gathered
// through `gather` (map_a then the map of gather.copy_to, 64-row boxes, if it is given).
template <gemm::BLoad kB, bool kGatherA = false, class Epilogue>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b0, const CUtensorMap& map_b1,
            const gemm::Problem& p, const Epilogue& epilogue, int num_sms, cudaStream_t stream,
            const gemm::RowGather& gather = {}) {
  using R = gemm::Ring<kStages>;
  constexpr int kBlockN = kB == gemm::BLoad::kPaired ? gemm::kMmaN / 2 : gemm::kMmaN;
  constexpr auto kernel = gemm::grouped_gemm_kernel<kB, kStages, Epilogue, kGatherA>;
  allow_shared_bytes<kernel>(R::kSharedBytes);
  // No more CTAs than tiles can exist: every expert adds at most one partial row tile.
  const std::int64_t n_tiles = (p.n + kBlockN - 1) / kBlockN;
  const std::int64_t most =
      ((p.num_rows + gemm::kBlockM - 1) / gemm::kBlockM + p.num_experts) * n_tiles;
  const int grid =
      static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_sms, most)));
  kernel<<<grid, gemm::kThreads, R::kSharedBytes, stream>>>(map_a, map_b0, map_b1, p, epilogue,
                                                            gather);
  check(cudaGetLastError(), "launching a grouped GEMM");
}

}  // namespace mok::bf16::kernels
