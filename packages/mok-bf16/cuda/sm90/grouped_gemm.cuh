// The grouped GEMM of the experts on sm_90a: C_e = A[rows of segment e] @ B_e for every local
// expert e, A K-major bf16 (rows of the schedule table), B the expert's weight (K-major, or
// N-major: see BLoad), fp32 accumulators, an epilogue per output tile.
//
// Segments are rows [offsets[e], offsets[e+1]) of A, read from device memory (the schedule
// table's), never by the host. A CTA is persistent: it walks output tiles t = blockIdx.x,
// blockIdx.x + gridDim.x, ... of mok/core/grouped_tiles.cuh's list (expert by expert, bands of
// 16 row tiles, column tiles, row tiles fastest). Warpgroup 0 is the producer (one thread issues
// the copy engine's loads into a ring of kStages stages; or, kGatherA, its 128 threads gather A's
// rows themselves, RowGather), warpgroups 1 and 2 the consumers: each
// owns 64 of the tile's 128 rows and issues wgmma for them, the second kLagBlocks k-blocks behind
// the first; bf16 epilogues are deferred into the next tile's first k-blocks.
//
// Determinism (docs/determinism.md): an output element is one CTA's fp32 sum over K in blocks of
// 64, each block four wgmma k16 steps in ascending order, with no split of K. Nothing depends on
// which CTA computes a tile, on the grid size, on where the tile's rows sit in A or on the other
// rows of the tile: a row's result depends only on that row and the expert's weights, so the
// GEMMs are batch invariant and invariant under any split of the rows into calls.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "mok/core/bf16.h"
#include "mok/core/grouped_tiles.cuh"
#include "mok/core/hopper.cuh"
#include "mok/core/pipeline.cuh"

namespace mok::bf16::gemm {

using tiles::for_each_pair;
using tiles::frag_col;
using tiles::frag_row;
using tiles::kBlockM;
using tiles::kMaxExperts;
using tiles::locate;
using tiles::Problem;
using tiles::Tile;
using tiles::TileList;

inline constexpr int kBlockK = 64;    // K per stage: one 128-byte swizzle row of bf16
inline constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups

// The second consumer warpgroup starts kLagBlocks k-blocks after the first and stays about that
// far behind: the two then reach a tile's end (the wait for the last wgmmas, the rounding, the
// next tile's first loads) at different times, and the tensor cores run the other's wgmmas
// meanwhile. The ring (kStages stages, each given back by both) bounds the lag.
inline constexpr int kLagBlocks = 2;

// Where B's tiles come from. B_e is [K, N] as the GEMM reads it.
//  kPaired: K-major maps [El * N, K] (weights [El, N, K], nn.Linear's); B's two 128-row halves
//           from map_b0 and map_b1 (gate and up), output tiles of 128 columns of each.
//  kKMajor: one K-major map [El * N, K]; output tiles of 256 columns.
//  kNMajor: N-major maps [El * K', N] (weights [El, K', N] used untransposed); K rows
//           [0, k_split) of expert e from map_b0's rows e * k_split.., the rest from map_b1's
//           rows e * (k - k_split).. (dx = [d_a, d_b] @ [Wg; Wu] reads two weights one after the
//           other); output tiles of 256 columns.
enum class BLoad { kPaired, kKMajor, kNMajor };

// Rows gathered by a producer warpgroup's own copies where no routed copy of them exists (the
// copy engine cannot gather; the megakernel's gate/up tiles, sm90/moe_forward.cu, and the
// backward's g GEMM, experts_backward.cu): table row r reads row row_route[r] / divisor of `rows`
// ([*, cols] bf16 row-major: the token rows), zeros for a padding row (route -1; any route outside
// [0, num_routes) reads as one), a row past the table and columns from `cols` on. The pieces land
// where the copy engine would put them (128-byte swizzle), so the wgmmas read the same shared
// memory either way. With `copy_to`, the tiles of column 0 also store the rows they gathered
// there in table order (store_gathered_rows): a routed copy for the kernels after, made without a
// pass of its own.
struct RowGather {
  const std::uint16_t* rows;
  const std::int32_t* row_route;
  std::int64_t num_rows;   // rows of the table
  int num_routes;          // routes: source rows x divisor
  int divisor;             // routes per source row (K)
  int cols;                // elements per source row
  std::uint16_t* copy_to;  // [num_rows, cols] bf16 row-major, or null

  // Table row r's route as the table holds it (-1 past the table): a lookup ahead of its use
  // keeps it raw, so that nothing waits for the load until the row is copied.
  __device__ int route(std::int64_t r) const { return r < num_rows ? row_route[r] : -1; }
  // The source row a route reads (-1: none, zeros).
  __device__ int source_of(int route) const {
    return route < 0 || route >= num_routes ? -1 : route / divisor;
  }
  __device__ int source(std::int64_t r) const { return source_of(route(r)); }
};

// The 128 producer threads' copies of one 128-byte-swizzled box: 128-byte piece q (a row of the
// box) from source row src(q) at column `col` (src: the row's index in g.rows, -1 for zeros; or
// the row's own address, null for zeros: the megakernel across ranks, each row in its source
// rank's rows). Thread i copies 16-byte chunk i % 8 of pieces
// i / 8 + 16 j (j < kPieces / 16): a warp's 32 copies are four whole 128-byte pieces, so every
// request is a full line. Each thread then arrives on the stage (cp_async_arrive) once its
// copies have landed.
template <int kPieces, class Source>
__device__ inline void gather_box(unsigned char* box, const RowGather& g, int col, int i,
                                  const Source& src) {
  static_assert(kPieces % 16 == 0);
  const int chunk = i % 8;
  const int swizzled = (chunk ^ ((i / 8) & 7)) << 4;  // pieces i / 8 + 16 j share piece % 8
  const bool in_cols = col + 8 * chunk < g.cols;
#pragma unroll
  for (int j = 0; j < kPieces / 16; ++j) {
    const int piece = i / 8 + 16 * j;
    const auto s = src(j);
    bool valid;
    const std::uint16_t* from;
    if constexpr (std::is_pointer_v<decltype(s)>) {
      valid = s != nullptr && in_cols;
      from = valid ? s + col + 8 * chunk : g.rows;
    } else {
      valid = s >= 0 && in_cols;
      from = g.rows + (valid ? static_cast<std::int64_t>(s) * g.cols + col + 8 * chunk : 0);
    }
    hopper::cp_async_16_zfill(box + piece * 128 + swizzled, from, valid ? 16 : 0);
  }
}

// Registers of the bf16 GEMMs' warpgroups (hopper::RegisterSplit checks them against the CTA's
// pool). WideConsumerRegs: the consumers' 240 hold the deferred epilogue's packed tile beside the
// accumulators, and the producer, one thread driving the copy engine, keeps the fewest.
// GatherRegs: the grouped GEMM's and the megakernel's 128 producer threads gather A by cp.async
// with 40, and the consumers give up 8 each.
using WideConsumerRegs = hopper::RegisterSplit<24, 240>;
using GatherRegs = hopper::RegisterSplit<40, 232>;
template <bool kGatherA>
using RegsFor = std::conditional_t<kGatherA, GatherRegs, WideConsumerRegs>;
// The producer warpgroup's named barrier (1 is the weight-gradient GEMM consumers').
inline constexpr int kProducerBarrier = 2;

// A consumer warpgroup's 64 rows of a gathered stage's A (`box`: gather_box's 128-byte swizzle,
// 16-byte chunk c of row r at (c ^ r % 8) * 16) into g.copy_to, table rows [first, end) of them
// (padding rows are zeros in the stage), columns [col, col + 64), by the warpgroup's threads.
// Thread t takes chunks t + 128 j: a warp's loads read 4 whole rows (each phase of 8 threads one
// row: all 32 banks) and its stores write 4 whole 128-byte row pieces; one vector in flight, as
// the consumers' registers are few. For a half the segment's end cuts (store_gathered_rows).
template <class Row>
__device__ inline void store_box_rows(const RowGather& g, const unsigned char* box, Row first,
                                      Row end, int col) {
  const int t = threadIdx.x % 128;
#pragma unroll 1
  for (int j = 0; j < 64 * 8 / 128; ++j) {
    const int q = t + 128 * j;
    const int r = q / 8, c = q % 8;
    if (first + r < end) {
      const uint4 v = *reinterpret_cast<const uint4*>(box + r * 128 + ((c ^ (r % 8)) << 4));
      *reinterpret_cast<uint4*>(g.copy_to + static_cast<std::int64_t>(first + r) * g.cols + col +
                                8 * c) = v;
    }
  }
}

// The gathered rows' table-ordered copy (RowGather::copy_to), a consumer warpgroup's 64 rows of a
// k-block's stage at a time, called after the k-block's wgmmas are issued and before the stage is
// given back. A half inside the segment (every half where segments start at multiples of 64
// rows, as the backward's alignment makes them) is stored by the copy engine: the leader fences
// the gather's writes for the async proxy and has `map` (copy_to's, 64-row boxes, the swizzle the
// gather wrote) store the box, no instruction of the other threads spent on it; it first waits
// for the previous k-block's store to have read its stage (`pending`), which is given back next.
// A half the segment's end cuts is copied by the threads (store_box_rows); rows past the segment
// are never stored (they are the next expert's). first < 0: nothing to store (only the wait).
template <class Row>
__device__ inline void store_gathered_rows(const CUtensorMap* map, const RowGather& g,
                                           const unsigned char* box, Row first, Row end, int col,
                                           bool leader, bool& pending) {
  if (leader && pending) {
    hopper::bulk_wait_read<0>();
    pending = false;
  }
  if (first < 0 || end <= first) return;
  if (end - first >= 64) {
    if (leader) {
      hopper::fence_proxy_async();
      hopper::tma_store_2d(map, box, col, static_cast<int>(first));
      hopper::bulk_commit();
      pending = true;
    }
  } else {
    store_box_rows(g, box, first, end, col);
  }
}

// Before a tile's last stage is given back: the leader's last store has read it.
__device__ inline void gathered_rows_read(bool leader, bool& pending) {
  if (leader && pending) {
    hopper::bulk_wait_read<0>();
    pending = false;
  }
}

// The MMA width: every GEMM issues m64n256k16 (the widest wgmma, the fewest shared-memory
// reads of A per flop). A paired GEMM (two weight matrices against the same rows, as gate and
// up) stages 128 rows of each in the two halves of the 256-row B tile, so a thread's
// accumulators hold the same output columns of both.
inline constexpr int kMmaN = 256;

// The shared-memory ring: stage s holds A [kARows x 64] (128 rows: a tile; the ping-pong g
// GEMM's 64: one warpgroup's) and B [256 x 64].
template <int kStages, int kARows = kBlockM>
struct Ring {
  static constexpr int kABytes = kARows * kBlockK * 2;
  static constexpr int kBBytes = kMmaN * kBlockK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kBytes = kStages * kStageBytes;
  static constexpr int kSharedBytes = kBytes + 1024;  // + alignment of the swizzled tiles
  static_assert(kStageBytes % 1024 == 0, "the swizzled tiles start at multiples of 1024 bytes");

  unsigned char* base;  // 1024-byte aligned
  __device__ unsigned char* a(int s) const { return base + s * kStageBytes; }
  __device__ unsigned char* b(int s) const { return a(s) + kABytes; }
};

// The consumer side of a bf16 GEMM's ring (hopper::Pipeline's protocol), one for every bf16
// mainloop (the grouped GEMM's, the weight gradients', the megakernel's): the stage of the next
// k-block and its phase; the stage to give back once the next k-block's group is issued (one
// group of wgmmas stays queued), to this CTA's producer or, kCluster > 1, to the producers of
// every CTA of the cluster (they multicast into it); consumer 0's release of consumer 1 after
// kLagBlocks k-blocks.
template <int kStages, int kCluster = 1>
struct ConsumerRing {
  hopper::Pipeline<kStages> stages;
  std::uint64_t* lag;
  bool releases;  // the warpgroup's thread that arrives on the barriers
  bool lag_due;   // consumer 0, until it has let consumer 1 start
  hopper::RingPos<kStages> pos;
  int previous = -1;
  int lag_blocks = 0;

  // The next k-block's stage, once it is full.
  __device__ int acquire() { return stages.wait(pos); }
  // After the k-block's wgmmas are committed: the group before them done, its stage given back.
  __device__ void release() {
    hopper::wgmma_wait<1>();
    if (previous >= 0 && releases) give_back(previous);
    if (lag_due && ++lag_blocks == kLagBlocks) let_go();
    previous = pos.stage;
    pos.advance();
  }
  __device__ void begin_tile() { previous = -1; }
  // After a tile's last wgmmas are waited for: the last stage back, and consumer 1 let go if the
  // first tile had fewer than kLagBlocks k-blocks.
  __device__ void end_tile() {
    if (previous >= 0 && releases) give_back(previous);
    let_go();
  }
  // Consumer 1 may start (at once, whatever the k-blocks done: before a wait it must meet).
  __device__ void let_go() {
    if (!lag_due) return;
    if (releases) hopper::mbar_arrive(lag);
    lag_due = false;
  }

 private:
  __device__ void give_back(int s) const { stages.template release<kCluster>(s); }
};

// The accumulators of one consumer warpgroup: 64 rows x 256 columns. For a paired GEMM the
// fragment's n8 blocks j < 16 are the first weight's columns 8 j.., j >= 16 the second's.
struct Accumulators {
  float d[kMmaN / 2];
};

// ------------------------------------------------------------------ deferred epilogues
//
// An epilogue that stores bf16 may be deferred: after a tile's last wgmma its consumer only
// rounds the accumulators into bf16 (PackedBf16, 64 registers), and stores them in kDrainChunks
// pieces while the tensor cores run the next tile's first k-blocks (one piece after each
// k-block's wgmmas are issued), so the stores no longer leave the tensor cores idle between
// tiles. The bits stored are the same; only when they are stored changes.
//
// Such an epilogue declares `static constexpr bool kDeferred = true` and has
// `template <int kChunk> void store(const Tile&, int consumer, const PackedBf16&) const`,
// which stores piece kChunk (for_each_vector_in_chunk).
inline constexpr int kDrainChunks = 8;

// A consumer's rounded tile as the stores write it: v[2 k + half] = the 8 columns of n8 block
// 4 k + lane % 4 of the thread's row `half` (frag_row(t, 2 half)), k < kDrainChunks. A quad
// (four threads, one row) holds 64 consecutive bytes of a row in each pair of its vectors, so a
// warp's 16-byte stores write whole 32-byte sectors; the fragment's own layout (a thread's
// columns 2c, 2c + 1 of every n8 block) would cover each sector only half per store.
struct PackedBf16 {
  uint4 v[2 * kDrainChunks];
};
static_assert(kMmaN / 8 == 4 * kDrainChunks, "a piece is one quad's four n8 blocks");

// The four packed words a thread holds of n8 blocks j0 .. j0 + 3 of one of its rows (w_i:
// columns 2c, 2c + 1 of block j0 + i, c = the thread's lane % 4), exchanged across the four
// threads of its quad (they hold the same row) so that the thread holds block j0 + c whole:
// word i of the result is columns 2i, 2i + 1 of it. Two butterfly steps: the lane's bit 0
// swaps with the word index's bit 0, then bit 1 with bit 1. Every lane of the warp calls it.
__device__ inline uint4 quad_transpose(std::uint32_t w0, std::uint32_t w1, std::uint32_t w2,
                                       std::uint32_t w3) {
  const int c = threadIdx.x % 4;
  const bool odd = (c & 1) != 0;
  std::uint32_t x = __shfl_xor_sync(0xFFFFFFFFu, odd ? w0 : w1, 1);
  std::uint32_t y = __shfl_xor_sync(0xFFFFFFFFu, odd ? w2 : w3, 1);
  if (odd) {
    w0 = x;
    w2 = y;
  } else {
    w1 = x;
    w3 = y;
  }
  const bool high = (c & 2) != 0;
  x = __shfl_xor_sync(0xFFFFFFFFu, high ? w0 : w2, 2);
  y = __shfl_xor_sync(0xFFFFFFFFu, high ? w1 : w3, 2);
  if (high) {
    w0 = x;
    w1 = y;
  } else {
    w2 = x;
    w3 = y;
  }
  return make_uint4(w0, w1, w2, w3);
}

// Transposes an 8 x 8 matrix of bf16 held as the mma fragment (lane l: row l / 4, columns
// 2 (l % 4), 2 (l % 4) + 1 in one word): lane l then holds column l / 4, rows 2 (l % 4) and
// 2 (l % 4) + 1. Every lane of the warp calls it.
__device__ inline std::uint32_t transpose_8x8(std::uint32_t w) {
  std::uint32_t t;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(t) : "r"(w));
  return t;
}

// The accumulators rounded into the stores' layout. Every thread of the warpgroup calls it.
// kTransposed (the weight-gradient GEMM's C stored transposed): each n8 block's 8 x 8 pieces
// transposed in the warp first, so that lane (q = lane / 4, c = lane % 4) holds rows 8 h .. 8 h +
// 7 of its warp's 16 (frag_row) in column 8 (4 k + c) + q of the tile: one 16-byte run of a row
// of C^T.
template <bool kTransposed = false>
__device__ inline void pack_bf16(const Accumulators& acc, PackedBf16& out) {
  const auto word = [&](int j, int half) {  // columns 2c, 2c + 1 of n8 block j, row `half`
    const std::uint32_t w =
        core::float_to_bf16x2(acc.d[4 * j + 2 * half], acc.d[4 * j + 2 * half + 1]);
    if constexpr (kTransposed) return transpose_8x8(w);
    return w;
  };
#pragma unroll
  for (int k = 0; k < kDrainChunks; ++k) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j0 = 4 * k;
      out.v[2 * k + half] = quad_transpose(word(j0, half), word(j0 + 1, half), word(j0 + 2, half),
                                           word(j0 + 3, half));
    }
  }
}

// Piece kChunk of a consumer's rounded tile: fn(half, row, j, v) for each of the thread's two
// rows (row: the row in the consumer's 64, frag_row), v = the 8 columns of n8 block j (columns
// 8 j ..) of that row, j = 4 kChunk + lane % 4; fn skips the rows and columns that do not
// exist. For a paired tile, blocks j >= 16 are the second weight's (the accumulators' order).
template <int kChunk, class Fn>
__device__ inline void for_each_vector_in_chunk(const PackedBf16& p, const Fn& fn) {
  const int t = threadIdx.x % 128;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    fn(half, tiles::frag_row(t, 2 * half), 4 * kChunk + t % 4, p.v[2 * kChunk + half]);
  }
}

template <class E, class = void>
struct IsDeferred : std::false_type {};
template <class E>
struct IsDeferred<E, std::void_t<decltype(E::kDeferred)>> : std::bool_constant<E::kDeferred> {};

// A deferred epilogue may also have `void at_tile_end(const Tile&, int consumer, const
// PackedBf16&) const`: called at once with each tile's rounded words (the gate/up GEMM's h), the
// accumulators set to constants first so that their registers are free for it.
template <class E, class = void>
struct HasTileEnd : std::false_type {};
template <class E>
struct HasTileEnd<E, std::void_t<decltype(&E::at_tile_end)>> : std::true_type {};

// fn(std::integral_constant<int, i>{}) for i = 0 .. kN - 1: a loop whose index is a constant
// in each copy (register arrays indexed by it stay in registers).
template <int kN, class Fn, int... kI>
__device__ inline void unroll_impl(const Fn& fn, std::integer_sequence<int, kI...>) {
  (fn(std::integral_constant<int, kI>{}), ...);
}
template <int kN, class Fn>
__device__ inline void unroll(const Fn& fn) {
  unroll_impl<kN>(fn, std::make_integer_sequence<int, kN>{});
}

// ------------------------------------------------------------------ the consumers' tile loop

// One k-block's wgmmas on a consumer warpgroup: four k16 steps in ascending order, A from the
// warpgroup's rows at shared address `a`, B at `b`, one commit group. kTransA / kTransB: that
// operand is MN-major (its k16 steps 16 rows, 2048 bytes, apart: smem_desc_mn), else K-major (32
// bytes apart: smem_desc). `accumulate`: the first step adds to the accumulators (false: it
// overwrites them, a tile's first k-block with no carried start); the other steps always add.
template <int kTransA, int kTransB>
__device__ inline void mma_k_block(Accumulators& acc, std::uint32_t a, std::uint32_t b,
                                   bool accumulate) {
  const auto desc = [](std::uint32_t addr, bool mn_major) {
    return mn_major ? hopper::smem_desc_mn(addr) : hopper::smem_desc(addr);
  };
  constexpr std::uint32_t kStepA = kTransA ? 2048 : 32, kStepB = kTransB ? 2048 : 32;
  hopper::wgmma_fence();
#pragma unroll
  for (int k = 0; k < kBlockK / 16; ++k) {
    hopper::Wgmma<kMmaN>::mma<kTransA, kTransB>(acc.d, desc(a + kStepA * k, kTransA != 0),
                                                desc(b + kStepB * k, kTransB != 0),
                                                k != 0 || accumulate);
  }
  hopper::wgmma_commit();
}

// A consumer warpgroup's tile of a bf16 GEMM, the mainloop the grouped GEMM, the weight-gradient
// GEMM and the megakernel's tasks share: k_block(kb) for each of the tile's k-blocks (its stage
// acquired from `pipe`, its wgmmas issued, the stage before it released). With a deferred
// epilogue (kDrain), the previous tile's piece c is stored by drain(c) right after k-block c,
// and, kDrainAfter, the pieces past the tile's k-blocks after the loop (the megakernel stores
// them all before a short task instead). Then the last wgmmas are waited for, settle() runs
// (what must be done before the tile's last stage goes back) and the last stage goes back.
template <bool kDrain, bool kDrainAfter, int kStages, int kCluster, class KBlock, class Drain,
          class Settle>
__device__ inline void consume_tile(ConsumerRing<kStages, kCluster>& pipe, Accumulators& acc,
                                    int k_blocks, const KBlock& k_block, const Drain& drain,
                                    const Settle& settle) {
  hopper::fence_regs(acc.d);
  pipe.begin_tile();
  if constexpr (kDrain) {
    unroll<kDrainChunks>([&](auto c) {
      if (c.value < k_blocks) {
        k_block(c.value);
        drain(c);
      }
    });
    for (int kb = kDrainChunks; kb < k_blocks; ++kb) k_block(kb);
    if constexpr (kDrainAfter) {
      unroll<kDrainChunks>([&](auto c) {
        if (c.value >= k_blocks) drain(c);
      });
    }
  } else {
    for (int kb = 0; kb < k_blocks; ++kb) k_block(kb);
  }
  hopper::wgmma_wait<0>();
  hopper::fence_regs(acc.d);
  settle();
  pipe.end_tile();
}

// The persistent kernel, B loaded as kB says, A by the copy engine from map_a or, kGatherA, by
// the producer warpgroup through `gather` (the tiles of column 0 then store the gathered rows into
// gather.copy_to where it is given, map_a being its tensor map: store_gathered_rows). Epilogue:
// `void operator()(const Tile&, int consumer, const Accumulators&) const` on the consumer
// warpgroup's 128 threads.
template <BLoad kB, int kStages, class Epilogue, bool kGatherA = false>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b0,
                        const __grid_constant__ CUtensorMap map_b1, Problem p, Epilogue epilogue,
                        const __grid_constant__ RowGather gather) {
  using R = Ring<kStages>;
  static_assert(kStages > kLagBlocks, "consumer 0 must get kLagBlocks stages before any release");
  constexpr bool kPaired = kB == BLoad::kPaired;
  constexpr int kBlockN = kPaired ? kMmaN / 2 : kMmaN;  // output columns per weight and tile
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t full[kStages];
  __shared__ alignas(8) std::uint64_t empty[kStages];
  __shared__ alignas(8) std::uint64_t lag;  // consumer 0 has issued kLagBlocks k-blocks
  __shared__ int prefix[kMaxExperts + 1];
  __shared__ int tile_source[kGatherA ? kBlockM : 1];  // a tile's rows: their source rows

  const R ring{hopper::swizzle_base(smem_raw)};
  const hopper::Pipeline<kStages> stages{full, empty};
  TileList list{prefix, 0};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) list.build(p, kBlockN, lane);
  list.n_tiles = (p.n + kBlockN - 1) / kBlockN;
  if (threadIdx.x == 32) {
    stages.init(kGatherA ? 128 : 1, 2);  // gathering: every producer thread arrives
    hopper::mbar_init(&lag, 1);
    hopper::fence_barrier_init();
  }
  __syncthreads();
  const int total = list.total(p);
  const int k_blocks = p.k / kBlockK;

  if (threadIdx.x < 128) {  // ---------------------------------------------- producer
    // B's k-block kb of `tile` by the copy engine, into stage `stage` (its bytes announced by the
    // caller).
    const auto load_b = [&](int stage, int kb, const Tile& tile) {
      const int b_row = tile.expert * p.n + tile.col0;  // K-major maps
      if constexpr (kPaired) {
        unsigned char* b = ring.b(stage);
        hopper::tma_load_2d(b, &map_b0, &full[stage], kb * kBlockK, b_row);
        hopper::tma_load_2d(b + R::kBBytes / 2, &map_b1, &full[stage], kb * kBlockK, b_row);
      } else if constexpr (kB == BLoad::kKMajor) {
        hopper::tma_load_2d(ring.b(stage), &map_b0, &full[stage], kb * kBlockK, b_row);
      } else {  // four boxes of 64 k-rows x 64 columns
        const int k0 = kb * kBlockK;
        const bool first = k0 < p.k_split;
        const CUtensorMap* map = first ? &map_b0 : &map_b1;
        const int row = first ? tile.expert * p.k_split + k0
                              : tile.expert * (p.k - p.k_split) + (k0 - p.k_split);
#pragma unroll
        for (int j = 0; j < kMmaN / 64; ++j) {
          hopper::tma_load_2d(ring.b(stage) + j * 64 * 128, map, &full[stage], tile.col0 + 64 * j,
                              row);
        }
      }
    };
    // The ring position as two counters (not a hopper::RingPos, as every other walk of a ring:
    // with one nvcc schedules this producer's code differently; not measured on a GPU, NOTES.md
    // session 29).
    int stage = 0;
    std::uint32_t phase = 0;
    const auto advance = [&] {
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    };
    if constexpr (kGatherA) {
      // Every thread copies a share of A's rows; thread 0 also has the copy engine load B.
      GatherRegs::producer();
      const int i = threadIdx.x;
      if (i == 0) {
        hopper::prefetch_tensor_map(&map_b0);
        if constexpr (kB != BLoad::kKMajor) hopper::prefetch_tensor_map(&map_b1);
      }
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Tile tile = locate(p, list, t, kBlockN);
        hopper::named_barrier(kProducerBarrier, 128);  // the last tile's sources are read
        const std::int64_t row = tile.row0 + i;
        tile_source[i] = row < tile.row_end ? gather.source(row) : -1;  // past the segment: zeros
        hopper::named_barrier(kProducerBarrier, 128);
        for (int kb = 0; kb < k_blocks; ++kb) {
          hopper::mbar_wait(&empty[stage], phase ^ 1);
          if (i == 0) {
            hopper::mbar_expect_tx_only(&full[stage], R::kBBytes);
            load_b(stage, kb, tile);
          }
          gather_box<kBlockM>(ring.a(stage), gather, kb * kBlockK, i,
                              [&](int j) { return tile_source[i / 8 + 16 * j]; });
          hopper::cp_async_arrive(&full[stage]);  // once this thread's copies have landed
          advance();
        }
      }
      return;
    }
    WideConsumerRegs::producer();
    if (threadIdx.x != 0) return;
    hopper::prefetch_tensor_map(&map_a);
    hopper::prefetch_tensor_map(&map_b0);
    if constexpr (kB != BLoad::kKMajor) hopper::prefetch_tensor_map(&map_b1);
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = locate(p, list, t, kBlockN);
      for (int kb = 0; kb < k_blocks; ++kb) {
        hopper::mbar_wait(&empty[stage], phase ^ 1);
        stages.expect(stage, R::kStageBytes);
        hopper::tma_load_2d(ring.a(stage), &map_a, &full[stage], kb * kBlockK,
                            static_cast<int>(tile.row0));
        load_b(stage, kb, tile);
        advance();
      }
    }
    return;
  }

  // ------------------------------------------------------------------------ consumers
  // Each k-block's four wgmmas form one group; the group before it is waited for (and its
  // stage given back) only after this one is issued, so the tensor cores always have one
  // queued. The accumulation order does not change: wgmmas on the same accumulators run in
  // issue order.
  RegsFor<kGatherA>::consumer();
  constexpr bool kDeferred = IsDeferred<Epilogue>::value;
  const int consumer = threadIdx.x / 128 - 1;  // 0 or 1: rows [64 c, 64 c + 64) of the tile
  // Consumer 0 lets consumer 1 start after kLagBlocks k-blocks.
  ConsumerRing<kStages> pipe{stages, &lag, threadIdx.x % 128 == 0, consumer == 0};
  Accumulators acc;
  // A gathered tile of column 0 with gather.copy_to: the warpgroup's first table row (its rows
  // are stored from each stage, store_gathered_rows), else -1; copy_end: the segment's end;
  // copy_pending: the leader's last store may still be reading its stage.
  std::int64_t copy_first = -1, copy_end = 0;
  bool copy_pending = false;
  const bool leader = threadIdx.x % 128 == 0;
  const auto k_block = [&](int kb) {
    const int stage = pipe.acquire();
    mma_k_block<0, kB == BLoad::kNMajor>(acc,
                                         hopper::smem_addr(ring.a(stage)) + consumer * 64 * 128,
                                         hopper::smem_addr(ring.b(stage)), kb != 0);
    if constexpr (kGatherA) {
      store_gathered_rows(&map_a, gather, ring.a(stage) + consumer * 64 * 128, copy_first, copy_end,
                          kb * kBlockK, leader, copy_pending);
    }
    pipe.release();
  };
  // The previous tile's rounded accumulators while they are being stored (deferred epilogues).
  PackedBf16 pending;
  Tile pending_tile{};
  bool has_pending = false;
  const auto drain = [&](auto chunk) {
    if constexpr (kDeferred) {
      if (has_pending) epilogue.template store<chunk.value>(pending_tile, consumer, pending);
    }
  };
  if (consumer == 1 && blockIdx.x < total) hopper::mbar_wait(&lag, 0);
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tile = locate(p, list, t, kBlockN);
    if constexpr (kGatherA) {
      const bool copy = gather.copy_to != nullptr && tile.col0 == 0;
      copy_first = copy ? tile.row0 + 64 * consumer : -1;
      copy_end = tile.row_end;
    }
    // Deferred: the previous tile's pieces stored under this tile's first k-blocks (those left
    // over, K shorter than kDrainChunks blocks, after them).
    consume_tile<kDeferred, true>(pipe, acc, k_blocks, k_block, drain, [&] {
      if constexpr (kGatherA) gathered_rows_read(leader, copy_pending);
    });
    if constexpr (kDeferred) {
      pack_bf16(acc, pending);
      pending_tile = tile;
      has_pending = true;
      if constexpr (HasTileEnd<Epilogue>::value) {
#pragma unroll
        for (int i = 0; i < kMmaN / 2; ++i) acc.d[i] = 0.0f;  // dead until the next tile's wgmma
        epilogue.at_tile_end(tile, consumer, pending);
      }
    } else {
      epilogue(tile, consumer, acc);
    }
  }
  if constexpr (kDeferred) unroll<kDrainChunks>([&](auto c) { drain(c); });
  if constexpr (kGatherA) {
    if (leader) hopper::bulk_wait<0>();  // the copy engine's stores done before the CTA ends
  }
}

}  // namespace mok::bf16::gemm
