// Quantizing a 32-element block held by several neighbouring lanes of a warp (format.h's
// arithmetic, its statistics merged with shuffles): the quantizer's row kernel and the
// backward's element pass share it.
#pragma once

#include <cstdint>

#include "mok/mxfp8/format.h"

namespace mok::mxfp8::kernels {

// The block's statistics from this lane's elements `v` (fp32 bit patterns), merged across the
// `kLanes` lanes that hold the block (neighbours: lane ^ 1, ^ 2, ...). Every lane of the warp
// must call it (the shuffles are warp-wide); the merge is an exact max and an and, so the result
// is quantize_block's.
template <int kLanes, int kPer>
__device__ inline BlockStats lane_block_stats(const std::uint32_t (&v)[kPer]) {
  BlockStats stats;
#pragma unroll
  for (int i = 0; i < kPer; ++i) stats.add(v[i]);
#pragma unroll
  for (int d = 1; d < kLanes; d <<= 1) {
    BlockStats other;
    other.amax = __shfl_xor_sync(0xFFFFFFFFu, stats.amax, d);
    other.finite = __shfl_xor_sync(0xFFFFFFFFu, stats.finite ? 1 : 0, d) != 0;
    stats.merge(other);
  }
  return stats;
}

// This lane's E4M3 bytes of its elements `v` under the block's `stats` and exponent `e`, four to
// a word, the first element in the lowest byte.
template <int kPer>
__device__ inline void lane_block_bytes(const BlockStats& stats, int e,
                                        const std::uint32_t (&v)[kPer],
                                        std::uint32_t (&packed)[kPer / 4]) {
#pragma unroll
  for (int i = 0; i < kPer; i += 4) {
    packed[i / 4] = static_cast<std::uint32_t>(stats.element(v[i], e)) |
                    static_cast<std::uint32_t>(stats.element(v[i + 1], e)) << 8 |
                    static_cast<std::uint32_t>(stats.element(v[i + 2], e)) << 16 |
                    static_cast<std::uint32_t>(stats.element(v[i + 3], e)) << 24;
  }
}

}  // namespace mok::mxfp8::kernels
