// The tile walk of mok's grouped GEMMs on sm_90a (mok-bf16, mok-mxfp8): output tiles of 128 rows
// over the experts' row segments, read from device memory (never by the host), and where a
// consumer warpgroup's wgmma accumulators sit in a tile. CUDA code: include it from .cu files.
//
// A CTA is persistent: it walks output tiles t = blockIdx.x, blockIdx.x + gridDim.x, ... of the
// list "expert by expert, then band of 16 row tiles, then column tile, then row tile" (row
// tiles fastest, so the CTAs of a wave share the expert's weight tiles; the bands keep a wave's
// rows of A few). Segments are rows [offsets[e], offsets[e+1]) of A, clamped to [0, num_rows];
// decreasing offsets give empty segments.
#pragma once

#include <cstdint>

namespace mok::tiles {

inline constexpr int kBlockM = 128;  // rows of an output tile (two consumer warpgroups of 64)

// The walk takes an expert's row tiles in bands of this many (2,048 rows): a wave of 132 CTAs
// then covers ~16 row tiles x ~8 column tiles, not all of a long expert's row tiles x one
// column tile, so it reads ~4x fewer distinct A rows from memory where an expert has many rows
// (mixtral's 16,384: 128 row tiles).
inline constexpr int kBandTiles = 16;
inline constexpr int kMaxExperts = 1024;

// What the tile walk needs, in device memory or by value.
struct Problem {
  const std::int64_t* offsets;  // [El + 1] segment starts (device)
  std::int64_t num_rows;        // rows of A (offsets are clamped to [0, num_rows])
  int num_experts;              // El in [1, kMaxExperts]
  int n;                        // output columns per expert (a multiple of 64)
  int k;                        // reduction size (a multiple of 64)
  int k_split = 0;              // K split over two weights: K rows per expert in the first
};

// The tile list of a CTA: per-expert tile counts, prefix-summed in shared memory.
struct TileList {
  int* prefix;  // [El + 1] in shared memory: tiles before expert e
  int n_tiles;  // column tiles per expert

  // Fills `prefix` (one warp; the caller synchronises the CTA afterwards).
  __device__ void build(const Problem& p, int block_n, int lane) {
    n_tiles = (p.n + block_n - 1) / block_n;
    const int per_lane = (p.num_experts + 31) / 32;
    const int first = lane * per_lane;
    int sum = 0;
    for (int e = first; e < first + per_lane && e < p.num_experts; ++e) sum += tiles_of(p, e);
    int before = sum;  // inclusive scan across the warp, then exclusive
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, before, d);
      if (lane >= d) before += v;
    }
    before -= sum;
    for (int e = first; e < first + per_lane && e < p.num_experts; ++e) {
      prefix[e] = before;
      before += tiles_of(p, e);
    }
    if (lane == 31) prefix[p.num_experts] = before;
  }

  __device__ int total(const Problem& p) const { return prefix[p.num_experts]; }

  __device__ int tiles_of(const Problem& p, int e) const {
    const std::int64_t lo = segment_start(p, e), hi = segment_end(p, e);
    return static_cast<int>((hi - lo + kBlockM - 1) / kBlockM) * n_tiles;
  }

  __device__ static std::int64_t clamp_row(const Problem& p, std::int64_t r) {
    return r < 0 ? 0 : (r > p.num_rows ? p.num_rows : r);
  }
  __device__ static std::int64_t segment_start(const Problem& p, int e) {
    return clamp_row(p, p.offsets[e]);
  }
  __device__ static std::int64_t segment_end(const Problem& p, int e) {
    const std::int64_t lo = segment_start(p, e), hi = clamp_row(p, p.offsets[e + 1]);
    return hi < lo ? lo : hi;
  }
};

// One output tile: expert, first row of A, end of the expert's rows, first column.
struct Tile {
  int expert;
  std::int64_t row0;
  std::int64_t row_end;
  int col0;
};

__device__ inline Tile locate(const Problem& p, const TileList& list, int t, int block_n) {
  int lo = 0, hi = p.num_experts - 1;  // the last expert whose prefix is <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (list.prefix[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int local = t - list.prefix[lo];
  const std::int64_t start = TileList::segment_start(p, lo);
  const std::int64_t end = TileList::segment_end(p, lo);
  const int m_tiles = static_cast<int>((end - start + kBlockM - 1) / kBlockM);
  // Bands of kBandTiles row tiles: every column tile of a band, row tiles fastest, then the
  // next band (the last one shorter).
  const int band = local / (kBandTiles * list.n_tiles);
  const int first = band * kBandTiles;
  const int rows = m_tiles - first < kBandTiles ? m_tiles - first : kBandTiles;
  const int in_band = local - band * kBandTiles * list.n_tiles;
  return {lo, start + static_cast<std::int64_t>(first + in_band % rows) * kBlockM, end,
          (in_band / rows) * block_n};
}

// The row ranges an elementwise kernel over the segments walks, as the tile walk reads the
// segments: fn(lo, hi) once with [offsets[0], offsets[El]) (clamped) when the offsets are
// non-decreasing (their segments are then that range, in order), else once per non-empty segment
// (a row in two overlapping segments is then visited twice: the kernels compute it alike).
// Every thread of the block must call it (a block-wide check of the order, through `sorted`).
template <class Fn>
__device__ inline void for_each_row_range(const std::int64_t* offsets, int num_experts,
                                          std::int64_t num_rows, int* sorted, const Fn& fn) {
  const auto clamp = [&](std::int64_t r) { return r < 0 ? 0 : (r > num_rows ? num_rows : r); };
  if (threadIdx.x == 0) *sorted = 1;
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    if (clamp(offsets[e + 1]) < clamp(offsets[e])) *sorted = 0;
  }
  __syncthreads();
  if (*sorted) {
    fn(clamp(offsets[0]), clamp(offsets[num_experts]));
    return;
  }
  for (int e = 0; e < num_experts; ++e) {
    const std::int64_t lo = clamp(offsets[e]), hi = clamp(offsets[e + 1]);
    if (hi > lo) fn(lo, hi);
  }
}

// Where the fragment element (j, q) of thread `t` of a consumer warpgroup sits in the tile.
__device__ inline int frag_row(int t, int q) { return 16 * (t / 32) + (t % 32) / 4 + 8 * (q / 2); }
__device__ inline int frag_col(int t, int j, int q) { return 8 * j + 2 * (t % 4) + (q % 2); }

// Calls fn(row, col, q) for every pair of adjacent output columns (col, col + 1) that the calling
// thread of a consumer warpgroup holds in its registers q, q + 1, among the first kCols columns
// of the tile; rows past the expert's segment and columns from n on are skipped.
template <int kCols, class Fn>
__device__ inline void for_each_pair(const Tile& tile, int consumer, int n, const Fn& fn) {
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = tile.row0 + 64 * consumer + frag_row(t, 2 * half);
    if (row >= tile.row_end) continue;
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      const int col = tile.col0 + frag_col(t, j, 0);
      if (col < n) fn(row, col, 4 * j + 2 * half);
    }
  }
}

}  // namespace mok::tiles
