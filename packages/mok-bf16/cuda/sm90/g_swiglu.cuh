// The backward's g GEMM with the SwiGLU backward in its epilogue, on sm_90a, in ping-pong:
//
//   g = dy @ Wd_e (fp32 accumulators; stored only where a caller asks for it: tests), then per
//   element hw = bf16(w h), d_a, d_b (mok-core's element math, as the SwiGLU kernel it replaces)
//   and per row d_w = <g, h> in that kernel's lane order (docs/determinism.md): the same bits.
//
// Why ping-pong (NOTES.md, sessions 19 and 46-47): the SwiGLU backward of a tile reads a and b and
// looks up sigmoids, a chain of memory round trips. At the end of a grouped GEMM tile, where both
// consumer warpgroups reach it together, it left the tensor cores and the loads idle (session 19's
// fused epilogue: slower than the two kernels it replaced). Here the two consumer warpgroups take
// turns: while one runs the epilogue of its piece, the other's mainloop has the tensor cores.
//
// The walk. A CTA takes the 128-row tiles t = blockIdx.x, blockIdx.x + gridDim.x, ... of the
// grouped GEMMs' tile list with one column tile per expert (grouped_tiles.cuh: the list's order),
// splits each into its blocks of 64 rows (one where the rows end before row 64) and each block into
// its column tiles of 256 columns, ascending: the CTA's units. Unit u goes to consumer warpgroup
// u % 2, so the two take turns. Their mainloops run in unit order (`turn`: a warpgroup waits for
// its turn and passes it once it has waited for its unit's last stage); one warpgroup's epilogue,
// the SwiGLU backward of its 64 x 256 piece of g, runs while the other's mainloop has the tensor
// cores. Where a block has several column tiles (I > 256), a row's d_w lane sums go from one unit
// of its block to the next through shared memory (`parts`), in the SwiGLU kernel's order, and the
// epilogues then run in unit order too (`epi_turn`), which makes that hand-over safe; with one
// column tile they need no order, and the two warpgroups' epilogues may overlap (an epilogue longer
// than a mainloop then costs half as much: NOTES.md, session 49). A block's units follow one
// another, so its dy rows are read again from L2 while they are still there (a CTA's live rows:
// 64). The producer fills the ring in unit order: each stage A = 64 rows of dy's k-block (the copy
// engine's, or gathered by the producer's threads through each row's route: RowGather), B = Wd_e's
// k-block of the unit's 256 columns (N-major boxes).
//
// The ring's protocol (hopper::Pipeline) with one reader a stage: only the unit's warpgroup waits
// for a stage and gives it back; the other steps its ring position over those stages without a
// wait. That is safe because the mainloops take turns: a warpgroup starts waiting for its unit's
// stages only once the unit before has waited for its last stage, so every stage it waits for is
// at most one fill ahead of the last fill any reader saw (a barrier's parity then names one fill).
// CUTLASS's ping-pong kernels order their math warpgroups the same way.
//
// Clusters of two (kCluster 2): each unit reads Wd's 256 columns for its 64 rows, twice the B a
// cooperative 128-row tile reads from L2. In a cluster the two CTAs take the same tiles, rank r
// block r of each (a ghost unit where the tile has one block: rows past the segment, nothing
// stored), so their stages hold the same B: each CTA's producer loads two of its four boxes and
// multicasts them into both CTAs, and each stage goes back to both producers (two readers a
// stage, one a CTA). The turns stay each CTA's own; a CTA's producer, last, waits until every
// stage is given back, so that no arrival from the other CTA is still on its way when it ends.
//
// Determinism: g's elements are the grouped GEMM's sums (K in blocks of 64, each four k16 steps in
// ascending order, one CTA, no split of K), so every output is what the g GEMM and the SwiGLU
// kernel gave: a row's results depend on that row and the expert's weights alone.
#pragma once

#include <cstdint>

#include "grouped_gemm.cuh"
#include "mok/core/expert_math.h"
#include "mok/core/sigmoid_table.cuh"

namespace mok::bf16::gemm {

inline constexpr int kHalfRows = kBlockM / 2;  // a unit's rows: one consumer warpgroup's
inline constexpr int kPieces = kDrainChunks;   // 8-column pieces of a thread's row per unit

// The ring of the ping-pong GEMM: stage s holds A [64 x 64] (one warpgroup's rows) and B [256 x
// 64].
template <int kStages>
using HalfRing = Ring<kStages, kHalfRows>;

// What the epilogue reads and writes (the SwiGLU backward's arrays, as experts_backward.cu's
// GroupedBackwardArgs name them).
struct GSwiglu {
  const std::uint16_t* a;            // [M, I]
  const std::uint16_t* b;            // [M, I]
  const float* router_weights;       // [M] (weight_route: [num_routes]) or null: all ones
  const std::int32_t* weight_route;  // [M] or null: row r's weight is router_weights[route]
  int num_routes;                    // routes outside [0, num_routes) weigh 0 (padding)
  std::uint16_t* hw;                 // [M, I]: bf16(w h)
  std::uint16_t* d_ab;               // [M, 2I]
  float* d_w;                        // [M] or null
  float* d_w_routes;                 // [num_routes] or null (with weight_route): d_w by route
  float* g;                          // [M, I] or null: g itself (kStoreG)
  int inner;
  core::SwigluLimit limit;
};

// A consumer thread's two rows of a tile (frag_row(t, 0) and frag_row(t, 2) of its warpgroup's 64)
// and their router weights, looked up as the unit starts: used after its mainloop.
struct ThreadRows {
  std::int64_t row[2];
  bool in[2];
  float w[2];
  int route[2];  // -1: no route (d_w_routes not written)
};

// Piece kK of the thread's two rows out of the accumulators: g8[half][i] = column i of n8 block
// 4 kK + c (c = lane % 4) of row `half`, from the quad's exchange (quad_transpose) of the
// fragment's words, the even columns' words and the odd ones' apart.
template <int kK>
__device__ inline void g_piece(const Accumulators& acc, float (&g8)[2][8]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const auto word = [&](int i, int odd) {
      return __float_as_uint(acc.d[4 * (4 * kK + i) + 2 * half + odd]);
    };
    const uint4 even = quad_transpose(word(0, 0), word(1, 0), word(2, 0), word(3, 0));
    const uint4 odd = quad_transpose(word(0, 1), word(1, 1), word(2, 1), word(3, 1));
    const std::uint32_t e[4] = {even.x, even.y, even.z, even.w};
    const std::uint32_t o[4] = {odd.x, odd.y, odd.z, odd.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      g8[half][2 * i] = __uint_as_float(e[i]);
      g8[half][2 * i + 1] = __uint_as_float(o[i]);
    }
  }
}

__device__ inline void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The thread's rows of block `block` of `tile` (rows [64 block, 64 block + 64)), their routes and
// weights (loads issued now, used after the mainloop).
__device__ inline ThreadRows thread_rows(const GSwiglu& e, const Tile& tile, int block) {
  ThreadRows r;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    r.row[half] = tile.row0 + kHalfRows * block + frag_row(threadIdx.x % 128, 2 * half);
    r.in[half] = r.row[half] < tile.row_end;
    r.route[half] = -1;
    r.w[half] = 1.0f;
    if (!r.in[half]) continue;
    if (e.weight_route != nullptr) {
      const int route = e.weight_route[r.row[half]];
      const bool routed = route >= 0 && route < e.num_routes;
      r.route[half] = routed ? route : -1;
      if (e.router_weights != nullptr) r.w[half] = routed ? e.router_weights[route] : 0.0f;
    } else if (e.router_weights != nullptr) {
      r.w[half] = e.router_weights[r.row[half]];
    }
  }
  return r;
}

// a and b of the thread's rows at column tile col0 into L2 while the unit's k-blocks run: thread c
// of a quad asks for the c-th 128-byte line of each row's 512 bytes.
__device__ inline void prefetch_ab(const GSwiglu& e, const ThreadRows& r, int col0) {
  const int col = col0 + 64 * (threadIdx.x % 4);
  if (col >= e.inner) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (!r.in[half]) continue;
    const std::int64_t at = r.row[half] * e.inner + col;
    prefetch_l2(e.a + at);
    prefetch_l2(e.b + at);
  }
}

// A warpgroup's epilogue's a and b, a piece at a time in shared memory: [slot][half][a, b]
// [thread], 16 bytes each (a warp's reads of one array and half are 512 contiguous bytes), two
// slots (the piece in use and the next one in flight). One buffer a warpgroup (their epilogues may
// run at once), in the dynamic shared memory after the ring (g_swiglu_shared_bytes).
struct AbSlots {
  uint4 v[2][2][2][128];
};

template <int kStages>
inline constexpr int g_swiglu_shared_bytes = HalfRing<kStages>::kSharedBytes + 2 * sizeof(AbSlots);

// The epilogue of one unit: the SwiGLU backward of the thread's two rows at columns col0 ..
// col0 + 255, the lane sums carried in `part` (part[k][half]: lane 4 k + c of row `half`; the
// array turns by one each piece, so that every index is a constant and it stays in registers, and
// is back in place after the eighth). Each piece's a and b are copied into `ab` by cp.async a
// piece ahead of their use (zeros where the row or columns are out): the wait for them is the
// explicit cp.async.wait_group, so nothing else waits on those loads (NOTES.md, session 49: as
// loads into registers a piece ahead, the first use of each piece's sigmoid waited for them).
template <bool kStoreG>
__device__ inline void g_swiglu_epilogue(const GSwiglu& e, const core::SharedSigmoid& sig,
                                         const ThreadRows& r, int col0, const Accumulators& acc,
                                         float (&part)[kPieces][2], AbSlots& ab) {
  const int c = threadIdx.x % 4, tid = threadIdx.x % 128;
  const auto load = [&](int k) {  // piece k into slot k % 2, one cp.async group
    const int col = col0 + 8 * (4 * k + c);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const bool in = r.in[half] && col < e.inner;
      const std::int64_t at = in ? r.row[half] * e.inner + col : 0;
      const std::uint32_t bytes = in ? 16 : 0;
      hopper::cp_async_16_zfill(&ab.v[k % 2][half][0][tid], e.a + at, bytes);
      hopper::cp_async_16_zfill(&ab.v[k % 2][half][1][tid], e.b + at, bytes);
    }
    hopper::cp_async_commit();
  };
  load(0);
#pragma unroll 1
  for (int k = 0; k < kPieces; ++k) {
    float g8[2][8];
    unroll<kPieces>([&](auto kk) {
      if (k == kk.value) g_piece<kk.value>(acc, g8);
    });
    if (k + 1 < kPieces) {
      load(k + 1);  // into the slot piece k - 1 used: its values were read then
      hopper::cp_async_wait<1>();
    } else {
      hopper::cp_async_wait<0>();
    }
    const uint4 a_now[2] = {ab.v[k % 2][0][0][tid], ab.v[k % 2][1][0][tid]};
    const uint4 b_now[2] = {ab.v[k % 2][0][1][tid], ab.v[k % 2][1][1][tid]};
    const int col = col0 + 8 * (4 * k + c);
    float done[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      done[half] = part[0][half];
      if (!r.in[half] || col >= e.inner) continue;
      const std::int64_t at = r.row[half] * e.inner + col;
      uint4 hv, dav, dbv;
      // The clamp off as a constant where it is (core::with_swiglu_limit): no clamps.
      done[half] = core::with_swiglu_limit(e.limit, [&](core::SwigluLimit lim) {
        return core::swiglu_backward8(g8[half], r.w[half], a_now[half], b_now[half], lim, sig,
                                      part[0][half], hv, dav, dbv);
      });
      *reinterpret_cast<uint4*>(e.hw + at) = hv;
      std::uint16_t* dab_row = e.d_ab + r.row[half] * 2 * e.inner;
      *reinterpret_cast<uint4*>(dab_row + col) = dav;
      *reinterpret_cast<uint4*>(dab_row + e.inner + col) = dbv;
      if constexpr (kStoreG) {
        float* to = e.g + at;
        *reinterpret_cast<float4*>(to) =
            make_float4(g8[half][0], g8[half][1], g8[half][2], g8[half][3]);
        *reinterpret_cast<float4*>(to + 4) =
            make_float4(g8[half][4], g8[half][5], g8[half][6], g8[half][7]);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i + 1 < kPieces; ++i) part[i][half] = part[i + 1][half];
      part[kPieces - 1][half] = done[half];
    }
  }
}

// d_w of the thread's rows once their last column tile is done: the SwiGLU kernel's butterfly
// over the 32 lane sums (xor 16, 8, 4 between the thread's own sums, the bits of k in lane 4 k +
// c; xor 2 and 1 across the quad, the bits of c), stored by thread c = 0.
__device__ inline void store_d_w(const GSwiglu& e, const ThreadRows& r,
                                 const float (&part)[kPieces][2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float s[kPieces];
#pragma unroll
    for (int k = 0; k < kPieces; ++k) s[k] = part[k][half];
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = core::add_rn(s[k], s[k + 4]);  // xor 16
#pragma unroll
    for (int k = 0; k < 2; ++k) s[k] = core::add_rn(s[k], s[k + 2]);  // xor 8
    float sum = core::add_rn(s[0], s[1]);                             // xor 4
    sum = core::add_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, 2));
    sum = core::add_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, 1));
    if (threadIdx.x % 4 != 0 || !r.in[half]) continue;
    if (e.d_w != nullptr) e.d_w[r.row[half]] = sum;
    if (e.d_w_routes != nullptr && r.route[half] >= 0) e.d_w_routes[r.route[half]] = sum;
  }
}

// Registers: the consumers keep 240 (the accumulators, the d_w lane sums and the epilogue's
// operands a piece ahead), the producer 24 even where its threads gather. ptxas's report: 4 bytes
// of spill stores (16 of loads) in the forms the layer runs, none where the producer gathers; at
// GatherRegs' 40 / 232 ~70-90 bytes.
using GRegs = WideConsumerRegs;

// The kernel. map_a: dy's rows in table order (64-row boxes), or, kGatherA, the map of
// gather.copy_to (the tiles' gathered rows are stored there from the units of column tile 0 where
// it is given); map_b: Wd [El * H, I], N-major boxes of 64 columns. p: K = H (p.k), N = I (p.n).
template <int kStages, bool kGatherA, bool kStoreG, int kCluster = 1>
__global__ void __launch_bounds__(kThreads, 1)
    g_swiglu_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b, Problem p, GSwiglu e,
                         const __grid_constant__ RowGather gather) {
  using R = HalfRing<kStages>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t full[kStages];
  __shared__ alignas(8) std::uint64_t empty[kStages];
  __shared__ alignas(8) std::uint64_t turn[2];      // turn[w]: warpgroup w's mainloop may start
  __shared__ alignas(8) std::uint64_t epi_turn[2];  // ... its epilogue may start
  __shared__ float parts[kPieces * 2][128];         // d_w's lane sums between a block's units
  __shared__ int prefix[kMaxExperts + 1];
  __shared__ int tile_source[kGatherA ? kBlockM : 1];
  __shared__ float sig_shared[core::SharedSigmoid::kEntries];

  const R ring{hopper::swizzle_base(smem_raw)};
  const hopper::Pipeline<kStages> stages{full, empty};
  const int n_cols = (p.n + kMmaN - 1) / kMmaN;  // the column tiles of a unit's rows
  const int block_n = n_cols * kMmaN;            // the list's one column tile per expert
  TileList list{prefix, 0};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) list.build(p, block_n, lane);
  list.n_tiles = 1;
  if (threadIdx.x == 32) {
    // One reader a stage in each CTA of the cluster (the unit's warpgroup): both CTAs' producers
    // write every stage (B's boxes multicast), so both CTAs' readers give it back.
    stages.init(kGatherA ? 128 : 1, kCluster);
    hopper::mbar_init(&turn[0], 1);
    hopper::mbar_init(&turn[1], 1);
    hopper::mbar_init(&epi_turn[0], 128);  // every thread: its stores of `parts` before it
    hopper::mbar_init(&epi_turn[1], 128);
    hopper::fence_barrier_init();
  }
  core::SharedSigmoid::fill(sig_shared, threadIdx.x, kThreads);
  __syncthreads();
  // The cluster's barriers exist before any CTA multicasts into them or arrives on them.
  if constexpr (kCluster > 1) hopper::cluster_sync();
  const int total = list.total(p);
  // In a cluster of two the CTAs take the same tiles, rank r its block r (a ghost where the tile
  // has one block: its rows are past the segment, so it stores nothing, but it takes part in the
  // stages, whose B both load); alone a CTA takes a tile's blocks.
  const int rank = kCluster > 1 ? static_cast<int>(hopper::cluster_rank()) : 0;
  const int first_tile = static_cast<int>(blockIdx.x) / kCluster;
  const int tile_stride = static_cast<int>(gridDim.x) / kCluster;
  const auto block_range = [&](const Tile& tile, int& lo, int& hi) {
    lo = kCluster > 1 ? rank : 0;
    hi = kCluster > 1 ? rank + 1 : (tile.row0 + kHalfRows < tile.row_end ? 2 : 1);
  };
  const int k_blocks = p.k / kBlockK;  // >= 1 (H a positive multiple of 64): a unit's last
                                       // k-block passes the turn

  if (threadIdx.x < 128) {  // ---------------------------------------------- producer
    GRegs::producer();
    const int i = threadIdx.x;
    if (!kGatherA && i != 0) return;
    if (i == 0) {
      if constexpr (!kGatherA) hopper::prefetch_tensor_map(&map_a);
      hopper::prefetch_tensor_map(&map_b);
    }
    hopper::RingPos<kStages> pos;
    for (int t = first_tile; t < total; t += tile_stride) {
      const Tile tile = locate(p, list, t, block_n);
      int h_lo, h_hi;
      block_range(tile, h_lo, h_hi);
      if constexpr (kGatherA) {
        hopper::named_barrier(kProducerBarrier, 128);  // the last tile's sources are read
        const std::int64_t row = tile.row0 + i;
        tile_source[i] = row < tile.row_end ? gather.source(row) : -1;  // past the segment: zeros
        hopper::named_barrier(kProducerBarrier, 128);
      }
      for (int h = h_lo; h < h_hi; ++h) {
        for (int n = 0; n < n_cols; ++n) {
          for (int kb = 0; kb < k_blocks; ++kb) {
            const int stage = stages.acquire(pos);
            const int k0 = kb * kBlockK;
            if (i == 0) {
              if constexpr (kGatherA) {
                hopper::mbar_expect_tx_only(&full[stage], R::kBBytes);
              } else {
                stages.expect(stage, R::kStageBytes);
                hopper::tma_load_2d(ring.a(stage), &map_a, &full[stage], k0,
                                    static_cast<int>(tile.row0) + kHalfRows * h);
              }
              // This CTA's share of B's four boxes (in a cluster multicast into both CTAs'
              // stage, whose full barrier expects every box).
              const int b_row = tile.expert * p.k + k0;
              constexpr int kShare = kMmaN / 64 / kCluster;
#pragma unroll
              for (int jj = 0; jj < kShare; ++jj) {
                const int j = rank * kShare + jj;
                if constexpr (kCluster > 1) {
                  hopper::tma_load_2d_multicast(ring.b(stage) + j * 64 * 128, &map_b, &full[stage],
                                                n * kMmaN + 64 * j, b_row, (1u << kCluster) - 1);
                } else {
                  hopper::tma_load_2d(ring.b(stage) + j * 64 * 128, &map_b, &full[stage],
                                      n * kMmaN + 64 * j, b_row);
                }
              }
            }
            if constexpr (kGatherA) {
              gather_box<kHalfRows>(ring.a(stage), gather, k0, i, [&](int j) {
                return tile_source[kHalfRows * h + i / 8 + 16 * j];
              });
              hopper::cp_async_arrive(&full[stage]);  // once this thread's copies have landed
            }
            pos.advance();
          }
        }
      }
    }
    if constexpr (kCluster > 1) {
      // The CTA stays until every stage is given back by the readers of both CTAs: no arrival
      // from the other CTA is then still on its way to this one's barriers.
      if (i == 0) {
        for (int s = 0; s < kStages; ++s) {
          stages.acquire(pos);
          pos.advance();
        }
      }
    }
    return;
  }

  // ------------------------------------------------------------------------ consumers
  GRegs::consumer();
  const int w = threadIdx.x / 128 - 1;                                 // takes units w, w + 2, ...
  AbSlots& ab = reinterpret_cast<AbSlots*>(ring.base + R::kBytes)[w];  // after the ring
  // The epilogues take turns only where a row's d_w lane sums go from one unit to the next (more
  // than one column tile: I > 256); else each unit's rows are its own and the two may overlap.
  const bool ordered = n_cols > 1;
  const int tid = threadIdx.x % 128;
  const bool leader = tid == 0;
  ConsumerRing<kStages, kCluster> pipe{stages, nullptr, leader, false};  // gives back to both
  Accumulators acc;
  // The sigmoid's entries in shared memory (sigmoid_table.cuh: the reference's bits).
  const core::SharedSigmoid sig{sig_shared, core::TableSigmoid::of(e.limit).at_limit};
  std::uint32_t turn_phase = 0;
  int unit = 0;  // the CTA's units so far
  // Gathered rows' table-ordered copy (RowGather::copy_to), as the grouped GEMM makes it.
  std::int64_t copy_first = -1, copy_end = 0;
  bool copy_pending = false;
  const auto k_block = [&](int kb) {
    const int stage = pipe.acquire();
    mma_k_block<0, 1>(acc, hopper::smem_addr(ring.a(stage)), hopper::smem_addr(ring.b(stage)),
                      kb != 0);
    if (kb + 1 == k_blocks && leader) hopper::mbar_arrive(&turn[1 - w]);  // its stages waited for
    if constexpr (kGatherA) {
      store_gathered_rows(&map_a, gather, ring.a(stage), copy_first, copy_end, kb * kBlockK, leader,
                          copy_pending);
    }
    pipe.release();
  };
  for (int t = first_tile; t < total; t += tile_stride) {
    const Tile tile = locate(p, list, t, block_n);
    int h_lo, h_hi;
    block_range(tile, h_lo, h_hi);
    // Unit i: block h_lo + i / n_cols, column tile i % n_cols.
    const int tile_units = (h_hi - h_lo) * n_cols;
    // This warpgroup's units of the tile: the CTA's units alternate between the two. (Walking
    // every unit and skipping the other's made ptxas spill ~340 bytes around the epilogue.)
    for (int i = (unit & 1) == w ? 0 : 1; i < tile_units; i += 2) {
      const int h = h_lo + i / n_cols, n = i % n_cols;
      const bool first = unit + i == 0;
      // The unit before, the other warpgroup's: its stages stepped over (none before the first).
      if (!first) {
        for (int kb = 0; kb < k_blocks; ++kb) pipe.pos.advance();
      }
      // Both waits below are for the unit before, the other warpgroup's (each warpgroup
      // passes the two turns once a unit, so a wait's parity names the one it needs).
      if (!first) hopper::mbar_wait(&turn[w], turn_phase);
      const ThreadRows rows = thread_rows(e, tile, h);
      prefetch_ab(e, rows, n * kMmaN);
      if constexpr (kGatherA) {
        const bool copy = gather.copy_to != nullptr && n == 0;
        copy_first = copy ? tile.row0 + kHalfRows * h : -1;
        copy_end = tile.row_end;
      }
      consume_tile<false, false>(
          pipe, acc, k_blocks, k_block, [](auto) {},
          [&] {
            if constexpr (kGatherA) gathered_rows_read(leader, copy_pending);
          });
      if (!first && ordered) hopper::mbar_wait(&epi_turn[w], turn_phase);
      turn_phase ^= first ? 0u : 1u;
      float part[kPieces][2];
#pragma unroll
      for (int k = 0; k < kPieces; ++k) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          part[k][half] = n == 0 ? 0.0f : parts[2 * k + half][tid];
        }
      }
      g_swiglu_epilogue<kStoreG>(e, sig, rows, n * kMmaN, acc, part, ab);
      if (n + 1 < n_cols) {
#pragma unroll
        for (int k = 0; k < kPieces; ++k) {
#pragma unroll
          for (int half = 0; half < 2; ++half) parts[2 * k + half][tid] = part[k][half];
        }
      } else {
        store_d_w(e, rows, part);
      }
      if (ordered) hopper::mbar_arrive(&epi_turn[1 - w]);
    }
    unit += tile_units;
  }
  if constexpr (kGatherA) {
    if (leader) hopper::bulk_wait<0>();  // the copy engine's stores done before the CTA ends
  }
}

}  // namespace mok::bf16::gemm
