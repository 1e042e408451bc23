// The experts' weight gradients on sm_90a: C_e[M, N] += A[rows of e]^T @ B[rows of e] for every
// local expert e, the rows (the table's, segment by segment) as the reduction dimension. A and
// B are row-major bf16 activations ([rows, M] and [rows, N]: d_ab and x for d[Wg; Wu], w*dy
// and h for dWd), both staged MN-major. C's rows [0, split) and [split, M) are two arrays
// (dWg and dWu from one GEMM over [d_a, d_b]), each an fp32 accumulator carried across calls
// and/or a bf16 output. With bf16 outputs only (kF32 false: no accumulator, nothing carried) the
// epilogue is deferred as the grouped GEMM's bf16 ones are: rounded into packed pairs after the
// tile's last wgmma, stored in pieces while the next tile's first k-blocks run.
//
// Tiles: per expert, 128 x 256 blocks of C (two consumer warpgroups of 64 rows), the list
// "expert, then column tile, then row tile"; a persistent CTA walks it as the grouped GEMM does
// (grouped_gemm.cuh: same ring, producer and consumers). An expert with no rows in this call
// gets C unchanged (its carried value, or +0) in the outputs.
//
// Clusters (kCluster 2): with few rows per expert a tile has few k-blocks, and the operands'
// reads from L2 bound the GEMM (ncu at qwen3-30b-a3b: L2 80 % busy, 8 k-blocks a tile). The two
// CTAs of a cluster take two row tiles of C with the same column tile, in step: the list is over
// groups of kCluster row tiles, and each k-block's B (the 256 columns both read) is loaded once
// for both, each CTA's producer multicasting half of its boxes; each loads its own A. A stage is
// refilled only once the consumers of both CTAs have given it back (they arrive on the barriers
// of both). A group past the last row tile (an odd count) computes the last row tile again
// without storing it (a ghost), so that both CTAs run the same k-blocks.
//
// Gathered A (kGatherA, dWd at one rank: WgradProblem::gather): A's rows are read through each
// table row's route from the token rows, where no table-ordered copy of them exists. The producer
// warpgroup's 128 threads copy them by cp.async into the stage (grouped_gemm.cuh's gather_box: the
// 128-byte swizzle a 64-row box of the copy engine would give, so the wgmmas read the same bytes;
// zeros for padding rows and rows past the segment), each route looked up four k-blocks ahead
// (every k-block of a weight gradient has new rows), and each thread arrives on the stage once its
// copies have landed; thread 0 has the copy engine load B as before.
//
// Transposed C (kTransposeC, dW1 as x^T [d_a, d_b], so that x is A and can be gathered as dWd's
// dy is): C is computed [rows of A's columns, B's columns] and stored transposed, its columns
// [0, split) into part[0] and [split, n) into part[1], each [El, columns, m] row-major (dWg and
// dWu [El, I, H] from C [H, 2I]). With bf16 outputs only the epilogue is deferred as above, each
// n8 block's 8 x 8 pieces transposed in the warp (movmatrix) and exchanged in the quad, so that a
// thread stores 16-byte runs of 8 rows of C (pack_bf16<true>); with fp32 accumulators each
// element is loaded and stored on its own at the tile's end (runs of 8 rows a quad: 32 bytes).
//
// Determinism (docs/determinism.md): a tile's accumulators start from C's fp32 values (or +0) and
// take the expert's rows in blocks of 64 counted from its segment start, each four wgmma k16 steps
// in ascending order. The last block of a segment is zero-padded in shared memory (rows past the
// segment belong to the next expert). So splitting an expert's rows over two calls gives the
// bits of one call exactly when the split falls on a multiple of 64 rows from the segment start;
// mok-torch's cuda backend uses these kernels only where every minibatch and segment boundary
// does (expert_alignment a multiple of 64).
#pragma once

#include <cstdint>

#include "grouped_gemm.cuh"
#include "mok/core/bf16.h"
#include "mok/core/hopper.cuh"

namespace mok::bf16::gemm {

// One part of C: rows [0, split) or [split, m) of every expert, [El, rows, n] row-major.
struct WgradPart {
  float* f32;           // the fp32 accumulator, or null
  std::uint16_t* bf16;  // the sums rounded to bf16, or null
};

struct WgradProblem {
  const std::int64_t* offsets;  // [El + 1] segment starts (device), clamped to [0, num_rows]
  std::int64_t num_rows;        // rows of A and B
  int num_experts;              // El >= 1
  int m;                        // rows of C per expert: columns of A (a multiple of 64)
  int n;                        // columns of C per expert: columns of B (a multiple of 64)
  int split;                    // C rows [0, split) in part[0], [split, m) in part[1] (columns
                                // with kTransposeC)
  WgradPart part[2];
  // Gathered A (kGatherA): A's rows through their routes from gather.rows (grouped_gemm.cuh's
  // RowGather; copy_to unused). gather.rows null: A is table-ordered (map_a's).
  RowGather gather;

  // Where element (e, row, col) of C lives in its part; `low`: in part[0].
  __device__ std::int64_t index(int e, int row, int col, bool low) const {
    const int rows = low ? split : m - split;
    const int r = low ? row : row - split;
    return (static_cast<std::int64_t>(e) * rows + r) * n + col;
  }
  // The same with C stored transposed (kTransposeC): part[0] holds columns [0, split).
  __device__ std::int64_t index_transposed(int e, int row, int col, bool low) const {
    const int cols = low ? split : n - split;
    const int c = low ? col : col - split;
    return (static_cast<std::int64_t>(e) * cols + c) * m + row;
  }
  // The part's arrays, chosen without indexing (a kernel parameter indexed at run time would
  // be copied to local memory).
  __device__ float* f32(bool low) const { return low ? part[0].f32 : part[1].f32; }
  __device__ std::uint16_t* bf16(bool low) const { return low ? part[0].bf16 : part[1].bf16; }
};

// A tile of C and the rows it reduces.
struct WgradTile {
  int expert;
  int row0;             // first row of C
  int col0;             // first column of C
  std::int64_t lo, hi;  // the expert's rows of A and B
  int blocks;           // 64-row blocks in [lo, hi)
  bool ghost;           // computed for the cluster's other CTA only, not stored
};

// Groups of kCluster row tiles of C (one tile each without clusters) in the list's order.
template <int kCluster>
__device__ inline int wgrad_groups(const WgradProblem& p) {
  const int m_groups = ((p.m + kBlockM - 1) / kBlockM + kCluster - 1) / kCluster;
  return p.num_experts * m_groups * ((p.n + kMmaN - 1) / kMmaN);
}

// Row tile `rank` of group t.
template <int kCluster>
__device__ inline WgradTile locate_wgrad(const WgradProblem& p, int t, int rank) {
  const int m_tiles = (p.m + kBlockM - 1) / kBlockM;
  const int m_groups = (m_tiles + kCluster - 1) / kCluster;
  const int n_tiles = (p.n + kMmaN - 1) / kMmaN;
  const int e = t / (m_groups * n_tiles), local = t % (m_groups * n_tiles);
  const int m_tile = (local % m_groups) * kCluster + rank;
  const bool ghost = m_tile >= m_tiles;
  const auto clamp = [&](std::int64_t r) { return r < 0 ? 0 : (r > p.num_rows ? p.num_rows : r); };
  const std::int64_t lo = clamp(p.offsets[e]);
  std::int64_t hi = clamp(p.offsets[e + 1]);
  if (hi < lo) hi = lo;
  return {e,
          (ghost ? m_tiles - 1 : m_tile) * kBlockM,
          (local / m_groups) * kMmaN,
          lo,
          hi,
          static_cast<int>((hi - lo + kBlockK - 1) / kBlockK),
          ghost};
}

// Zeroes rows [valid, 64) of a 64 x 64 bf16 box (each row 128 bytes; the swizzle only permutes
// 16-byte pieces within a row), with the `threads` threads numbered `t`.
__device__ inline void zero_box_rows(unsigned char* box, int valid, int t, int threads) {
  const int pieces = (kBlockK - valid) * 8;
  for (int i = t; i < pieces; i += threads) {
    *reinterpret_cast<uint4*>(box + valid * 128 + 16 * i) = make_uint4(0, 0, 0, 0);
  }
}

// Stores piece kChunk of a consumer's tile packed by pack_bf16<true>: each thread's two runs
// of 8 rows (16 bytes of a row of C^T in its part), row0 and col0 the consumer's first row and the
// tile's first column of C.
template <int kChunk>
__device__ inline void store_wgrad_piece_transposed(const PackedBf16& packed, int expert, int row0,
                                                    int col0, const WgradProblem& p) {
  const int t = threadIdx.x % 128;
  const int col = col0 + 8 * (4 * kChunk + t % 4) + (t % 32) / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + (t / 32) * 16 + 8 * half;
    if (row >= p.m || col >= p.n) continue;  // (m is a multiple of 64: a run is all in or all out)
    const bool low = col < p.split;
    *reinterpret_cast<uint4*>(p.bf16(low) + p.index_transposed(expert, row, col, low)) =
        packed.v[2 * kChunk + half];
  }
}

// Stores piece kChunk (grouped_gemm.cuh's kDrainChunks pieces, for_each_vector_in_chunk) of a
// tile's packed bf16 pairs, c16 at the consumer's first row of C.
template <int kChunk>
__device__ inline void store_wgrad_piece(const PackedBf16& packed, std::uint16_t* c16, int row0,
                                         int col0, const WgradProblem& p) {
  for_each_vector_in_chunk<kChunk>(packed, [&](int, int r, int j, const uint4& v) {
    const int col = col0 + 8 * j;
    if (row0 + r < p.m && col < p.n) *reinterpret_cast<uint4*>(c16 + r * p.n + col) = v;
  });
}

// kCarryIn: start from C's fp32 values; kF32: some part has an fp32 accumulator (else every
// part has a bf16 output, and the epilogue is deferred). Template arguments: a run-time choice
// there makes ptxas serialise the wgmmas. kCluster: CTAs per cluster (1 or 2, the launch's).
// kGatherA: A's rows through p.gather; kTransposeC: C stored transposed (both above).
template <int kStages, bool kCarryIn, bool kF32, int kCluster, bool kGatherA = false,
          bool kTransposeC = false>
__global__ void __launch_bounds__(kThreads, 1)
    wgrad_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                      const __grid_constant__ CUtensorMap map_b, WgradProblem p) {
  using R = Ring<kStages>;
  static_assert(kStages > kLagBlocks, "consumer 0 must get kLagBlocks stages before any release");
  static_assert(kF32 || !kCarryIn, "carrying C in needs its fp32 accumulators");
  static_assert(kCluster == 1 || kCluster == 2, "B's boxes are split between at most two CTAs");
  constexpr bool kDeferred = !kF32;
  constexpr int kBox = kBlockK * 128;  // bytes of a 64 x 64 box
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t full[kStages];
  __shared__ alignas(8) std::uint64_t empty[kStages];
  __shared__ alignas(8) std::uint64_t lag;  // consumer 0 has issued kLagBlocks k-blocks

  const R ring{hopper::swizzle_base(smem_raw)};
  const hopper::Pipeline<kStages> stages{full, empty};
  if (threadIdx.x == 32) {
    // Filled by the copy engine's thread (gathering: every producer thread arrives),
    // read by both consumers of every CTA of the cluster.
    stages.init(kGatherA ? 128 : 1, 2 * kCluster);
    hopper::mbar_init(&lag, 1);
    hopper::fence_barrier_init();
  }
  // The cluster's barriers exist before any CTA multicasts into them or arrives on them.
  if constexpr (kCluster > 1) {
    hopper::cluster_sync();
  } else {
    __syncthreads();
  }
  const int total = wgrad_groups<kCluster>(p);
  const int rank = kCluster > 1 ? static_cast<int>(hopper::cluster_rank()) : 0;
  const int first = static_cast<int>(blockIdx.x) / kCluster;
  const int stride = static_cast<int>(gridDim.x) / kCluster;

  if (threadIdx.x < 128) {  // ---------------------------------------------- producer
    WideConsumerRegs::producer();
    // This CTA's share of B's boxes of k-block rows [row, row + 64) (multicast in a cluster).
    const auto load_b = [&](int stage, int row, const WgradTile& tile) {
      constexpr int kShare = kMmaN / 64 / kCluster;  // B's boxes this CTA loads
#pragma unroll
      for (int jj = 0; jj < kShare; ++jj) {
        const int j = rank * kShare + jj;
        if constexpr (kCluster > 1) {
          hopper::tma_load_2d_multicast(ring.b(stage) + j * kBox, &map_b, &full[stage],
                                        tile.col0 + 64 * j, row, (1u << kCluster) - 1);
        } else {
          hopper::tma_load_2d(ring.b(stage) + j * kBox, &map_b, &full[stage], tile.col0 + 64 * j,
                              row);
        }
      }
    };
    hopper::RingPos<kStages> pos;
    if constexpr (kGatherA) {
      // Every producer thread copies a share of A's rows (gather_box: a warp's copies are whole
      // 128-byte lines; rows of padding or past the segment read as zeros); thread 0 also has
      // the copy engine load B. Thread i copies block rows i / 8 + 16 j of both boxes, so a
      // warp's copies take 16 rows: lane l looks the route of the warp's row l % 16 up (row
      // 4 (i / 32) + l % 4 + 16 (l / 4 % 4)) kAhead k-blocks before its copies, and the copies get
      // their rows' routes by shuffles. So the producer's pace is not one route's latency a
      // k-block (the rows of a weight gradient's k-blocks are new in every one).
      static_assert(kBlockM == 2 * kBlockK, "A's stage: two 64-column boxes of the block's rows");
      constexpr int kAhead = 4;
      const int i = threadIdx.x;
      const int lane = i % 32;
      const int looked_up = (i / 32) * 4 + lane % 4 + 16 * (lane / 4 % 4);
      if (i == 0) hopper::prefetch_tensor_map(&map_b);
      for (int t = first; t < total; t += stride) {
        const WgradTile tile = locate_wgrad<kCluster>(p, t, rank);
        // This lane's row of each k-block: its route raw (decoded at its use, so that nothing
        // reads the load's value until then), -1 past the segment (whose end is inside the
        // table: locate_wgrad clamps it).
        const std::int32_t* const routes = p.gather.row_route + tile.lo + looked_up;
        const int rows = static_cast<int>(tile.hi - tile.lo) - looked_up;
        const auto route = [&](int kb) { return kb * kBlockK < rows ? routes[kb * kBlockK] : -1; };
        int ahead[kAhead];  // raw routes of the next kAhead k-blocks
#pragma unroll
        for (int j = 0; j < kAhead; ++j) ahead[j] = route(j);
        for (int kb0 = 0; kb0 < tile.blocks; kb0 += kAhead) {
#pragma unroll
          for (int j = 0; j < kAhead; ++j) {
            const int kb = kb0 + j;
            if (kb >= tile.blocks) break;
            const int now = p.gather.source_of(ahead[j]);
            ahead[j] = route(kb + kAhead);
            const int stage = stages.acquire(pos);
            if (i == 0) {
              hopper::mbar_expect_tx_only(&full[stage], R::kBBytes);
              load_b(stage, static_cast<int>(tile.lo) + kb * kBlockK, tile);
            }
            int from[4];  // the routes of this thread's rows i / 8 + 16 q
#pragma unroll
            for (int q = 0; q < 4; ++q) from[q] = __shfl_sync(0xffffffffu, now, lane / 8 + 4 * q);
#pragma unroll
            for (int piece = 0; piece < 2; ++piece) {
              gather_box<kBlockK>(ring.a(stage) + piece * kBox, p.gather, tile.row0 + 64 * piece, i,
                                  [&](int q) { return from[q]; });
            }
            hopper::cp_async_arrive(&full[stage]);  // once this thread's copies have landed
            pos.advance();
          }
        }
      }
      if (i != 0) return;
    } else {
      if (threadIdx.x != 0) return;
      hopper::prefetch_tensor_map(&map_a);
      hopper::prefetch_tensor_map(&map_b);
      for (int t = first; t < total; t += stride) {
        const WgradTile tile = locate_wgrad<kCluster>(p, t, rank);
        for (int kb = 0; kb < tile.blocks; ++kb) {
          const int row = static_cast<int>(tile.lo) + kb * kBlockK;
          const int stage = stages.acquire(pos);
          stages.expect(stage, R::kStageBytes);
#pragma unroll
          for (int i = 0; i < kBlockM / 64; ++i) {
            hopper::tma_load_2d(ring.a(stage) + i * kBox, &map_a, &full[stage], tile.row0 + 64 * i,
                                row);
          }
          load_b(stage, row, tile);
          pos.advance();
        }
      }
    }
    if constexpr (kCluster > 1) {
      // The CTA stays until every stage is given back by the consumers of both CTAs: no arrival
      // from the other CTA is then still on its way to this one's barriers.
      for (int s = 0; s < kStages; ++s) {
        stages.acquire(pos);
        pos.advance();
      }
    }
    return;
  }

  // ------------------------------------------------------------------------ consumers
  // The second consumer runs about kLagBlocks k-blocks behind the first (grouped_gemm.cuh), so
  // their tile ends (the fp32 loads and the stores) overlap the other's wgmmas. A tile whose
  // rows end inside a block brings them together again (the zeroing's barrier).
  WideConsumerRegs::consumer();
  const int consumer = threadIdx.x / 128 - 1;  // rows [64 c, 64 c + 64) of the C tile
  const int t128 = threadIdx.x % 128;
  // Consumer 0 lets consumer 1 start after kLagBlocks k-blocks; stages go back to the producers
  // of every CTA of the cluster.
  ConsumerRing<kStages, kCluster> pipe{stages, &lag, t128 == 0, consumer == 0};
  Accumulators acc;
  // One k-block of `tile` (the last of a partial block: rows past the segment zeroed first).
  const auto k_block = [&](const WgradTile& tile, int kb, int tail) {
    const int stage = pipe.acquire();
    if (tail != 0 && kb == tile.blocks - 1) {
      // Rows past the segment: zero this consumer's A box and half of B's boxes, then meet
      // the other consumer so both see all of B zeroed before any wgmma reads it.
      pipe.let_go();  // consumer 1 must be running to meet us at the barrier below
      zero_box_rows(ring.a(stage) + consumer * kBox, tail, t128, 128);
      for (int j = 2 * consumer; j < 2 * consumer + 2; ++j) {
        zero_box_rows(ring.b(stage) + j * kBox, tail, t128, 128);
      }
      hopper::fence_proxy_async();
      hopper::named_barrier(1, 256);
    }
    // (The accumulators start from the carried sums or +0: every step adds.)
    mma_k_block<1, 1>(acc, hopper::smem_addr(ring.a(stage) + consumer * kBox),
                      hopper::smem_addr(ring.b(stage)), true);
    pipe.release();
  };
  // The previous tile's rounded sums while they are being stored (deferred epilogue).
  PackedBf16 pending;
  std::uint16_t* pending_c16 = nullptr;  // (kTransposeC: non-null where the tile is stored)
  int pending_row0 = 0, pending_col0 = 0, pending_expert = 0;
  const auto drain = [&](auto chunk) {
    if constexpr (kDeferred) {
      if (pending_c16 != nullptr) {
        if constexpr (kTransposeC) {
          store_wgrad_piece_transposed<chunk.value>(pending, pending_expert, pending_row0,
                                                    pending_col0, p);
        } else {
          store_wgrad_piece<chunk.value>(pending, pending_c16, pending_row0, pending_col0, p);
        }
      }
    }
  };
  if (consumer == 1 && first < total) hopper::mbar_wait(&lag, 0);
  for (int t = first; t < total; t += stride) {
    // A tile with no rows still writes C (its carried value, or +0), so every output exists.
    const WgradTile tile = locate_wgrad<kCluster>(p, t, rank);
    // This consumer's 64 rows of C lie in one part (split is a multiple of 64): its arrays from
    // the first of them, so the loads and stores below index them alike.
    const int row0 = tile.row0 + 64 * consumer;
    const bool low = row0 < p.split;
    const std::int64_t at = kTransposeC ? 0 : p.index(tile.expert, row0, 0, low);
    float* const c32 = p.f32(low) == nullptr ? nullptr : p.f32(low) + at;
    std::uint16_t* const c16 = p.bf16(low) == nullptr || tile.ghost ? nullptr : p.bf16(low) + at;
    // C transposed: element (row0 + r, col) of C, and its part.
    const auto transposed_at = [&](int r, int col) {
      return p.index_transposed(tile.expert, row0 + r, col, col < p.split);
    };
    // The carried fp32 partial (or +0) is the accumulators' start.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = frag_row(t128, 2 * half);
#pragma unroll
      for (int j = 0; j < kMmaN / 8; ++j) {
        const int col = tile.col0 + frag_col(t128, j, 0);
        const bool in = kCarryIn && row0 + r < p.m && col < p.n;
        float2 v;
        if constexpr (kTransposeC) {
          // col is even and so is split: col + 1 lies in the same part. Element (row0 + r, col)
          // and the next column's, m apart (at 0 where not loaded).
          const float* const from = p.f32(col < p.split) + (in ? transposed_at(r, col) : 0);
          v = in ? make_float2(from[0], from[p.m]) : make_float2(0.0f, 0.0f);
        } else {
          v = in ? *reinterpret_cast<const float2*>(c32 + r * p.n + col) : make_float2(0.0f, 0.0f);
        }
        acc.d[4 * j + 2 * half] = v.x;
        acc.d[4 * j + 2 * half + 1] = v.y;
      }
    }
    const int tail = static_cast<int>((tile.hi - tile.lo) % kBlockK);  // rows of a partial block
    // Deferred: the previous tile's pieces stored under this tile's first k-blocks (those left
    // over, fewer than kDrainChunks blocks, after them). At the end consumer 1 is let go if the
    // first tile had fewer than kLagBlocks blocks.
    consume_tile<kDeferred, true>(
        pipe, acc, tile.blocks, [&](int kb) { k_block(tile, kb, tail); }, drain, [] {});
    if constexpr (kDeferred) {
      pack_bf16<kTransposeC>(acc, pending);
      pending_c16 = c16;
      pending_row0 = row0;
      pending_col0 = tile.col0;
      pending_expert = tile.expert;
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = frag_row(t128, 2 * half);
#pragma unroll
        for (int j = 0; j < kMmaN / 8; ++j) {
          const int col = tile.col0 + frag_col(t128, j, 0);
          if (row0 + r >= p.m || col >= p.n || tile.ghost) continue;
          const float lo = acc.d[4 * j + 2 * half], hi = acc.d[4 * j + 2 * half + 1];
          if constexpr (kTransposeC) {  // each element on its own, in its column's part
            const bool part0 = col < p.split;
            float* const to32 = p.f32(part0);
            std::uint16_t* const to16 = p.bf16(part0);
            const std::int64_t at_lo = transposed_at(r, col), at_hi = transposed_at(r, col + 1);
            if (to32 != nullptr) {
              to32[at_lo] = lo;
              to32[at_hi] = hi;
            }
            if (to16 != nullptr) {
              const std::uint32_t w = core::float_to_bf16x2(lo, hi);
              to16[at_lo] = static_cast<std::uint16_t>(w);
              to16[at_hi] = static_cast<std::uint16_t>(w >> 16);
            }
          } else {
            if (c32 != nullptr) {
              *reinterpret_cast<float2*>(c32 + r * p.n + col) = make_float2(lo, hi);
            }
            if (c16 != nullptr) {
              *reinterpret_cast<std::uint32_t*>(c16 + r * p.n + col) =
                  core::float_to_bf16x2(lo, hi);
            }
          }
        }
      }
    }
  }
  if constexpr (kDeferred) unroll<kDrainChunks>([&](auto c) { drain(c); });
}

}  // namespace mok::bf16::gemm
