// The BF16 forward megakernel on sm_90a (docs/megakernel.md): a layer call's routed experts in
// one persistent launch, from the token rows to one output row per route.
//
// Tasks, in ticket order (mok/core/task_queue.cuh), over the row tiles of the schedule table
// (128 rows of an expert's segment; the walk of grouped_tiles.cuh: expert, band of 16 row tiles,
// column tile, row tile fastest):
//   gate/up tiles  [a, b] = x[rows] @ [Wg_e; Wu_e]^T, 128 rows x (128 columns of each weight).
//                  The rows' x are gathered from the token rows (row -> route t*K + k -> token t)
//                  by the operand loads themselves; the tile of column 0 also stores each
//                  k-block's gathered rows into x_out (the routed x the backward's weight
//                  gradients read, so that it pulls no x: the stage's bytes, stored by the copy
//                  engine while the wgmmas run, gemm::store_gathered_rows). Epilogue: at the
//                  tile's end h = bf16(silu(a_c) * b_c) (the reference's element math on the
//                  rounded a and b) from the thread's own words, stored at once; a and b, bf16 (as
//                  the chain's gate/up GEMM), deferred. h at the tile's end, not in the deferred
//                  pieces: there its sigmoid lookups stalled the wgmmas between which they ran
//                  (NOTES.md, session 11); at the tile's end the accumulators are dead, the lookups
//                  go out together, and the other consumer warpgroup's wgmmas run meanwhile.
//   down tiles     y = h[rows] @ Wd_e^T, 128 rows x 256 columns. Epilogue: each row stored at its
//                  route's row of `rows_out` (t*K + k; padding rows nowhere): nothing is summed
//                  here, the fixed-order combine follows in its own launch.
// One counter per row tile orders them: each consumer warpgroup bumps it once its part of a
// gate/up tile's h is stored; a down tile waits for 2 x the column tiles (every gate/up tile of
// the row tile).
//
// One CTA per SM, 384 threads:
//   producer warpgroup (40 registers). Thread 0 takes the tickets and hands them to everyone
//     through kTaskSlots shared slots (task_full / task_empty mbarriers; a named barrier for the
//     producer's own threads). Per stage every producer thread waits for the stage to be empty,
//     then
//       gate/up: the 128 threads copy A's rows by cp.async (16 bytes each, four whole 128-byte
//                row pieces per warp instruction, placed in the 128-byte swizzle the copy engine
//                would use; zero-filled for padding rows), and thread 0 has the copy engine load
//                B; each thread's arrival on the stage comes from cp.async.mbarrier.arrive, when
//                its copies have landed (the producer never waits for them);
//       down:    thread 0 waits for the row tile's counter (acquire, then a global async-proxy
//                fence: the copy engine reads h), then has the copy engine load A (h) and B (Wd);
//                every thread arrives at once.
//     full[s] takes 128 arrivals and the copy engine's bytes (thread 0 adds them with expect_tx
//     before its own arrival); empty[s] one arrival per consumer warpgroup.
//   consumer warpgroups 1 and 2 (232 registers): grouped_gemm.cuh's mainloop (m64n256k16, one
//     wgmma group in flight, the second warpgroup kLagBlocks k-blocks behind the first) and its
//     deferred bf16 epilogue: a tile's results are stored in 8 pieces under the next task's first
//     k-blocks. A gate/up tile's counter is bumped at the tile's end, after its h stores; no wait
//     depends on the deferred pieces of a and b (only the backward reads them), so no wait can
//     depend on work queued behind it.
//
// Determinism (docs/determinism.md): every output element is the grouped GEMMs' (grouped_gemm.cuh)
// fp32 sum over K in blocks of 64 by one CTA, rounded once; h the SwiGLU kernel's element math on
// the same rounded a and b.
// The bits are those of the chain of kernels (experts_forward.cu), for any grid size and whichever
// CTA takes a task.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "grouped_gemm.cuh"
#include "launch.cuh"
#include "mok/bf16/experts.h"
#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"
#include "mok/core/hopper.cuh"
#include "mok/core/pipeline.cuh"
#include "mok/core/sigmoid_table.cuh"
#include "mok/core/task_queue.cuh"
#include "swiglu_h_tile.cuh"

namespace mok::bf16::sm90 {
namespace {

using gemm::Accumulators;
using gemm::kBlockK;
using gemm::kDrainChunks;
using gemm::kMmaN;
using gemm::PackedBf16;
using gemm::unroll;
using tiles::frag_row;
using tiles::kBlockM;

constexpr int kStages = 4;
constexpr int kThreads = 384;
// The producer gathers A by cp.async with its 128 threads: the grouped GEMM's gathering split.
using Regs = gemm::GatherRegs;
constexpr int kTaskSlots = 4;
constexpr int kGateUpN = kMmaN / 2;  // columns of each weight per gate/up tile
constexpr int kDownN = kMmaN;
constexpr int kBandTiles = tiles::kBandTiles;
constexpr int kMaxExperts = tiles::kMaxExperts;

// Hardware barriers besides __syncthreads (0).
constexpr int kProducerBarrier = 1;
constexpr int kConsumerBarrier = 2;   // + consumer warpgroup (2, 3)
constexpr int kConsumersBarrier = 4;  // both consumer warpgroups (the end of the launch)

using R = gemm::Ring<kStages>;

enum Kind : int { kGateUp = 0, kDown = 1, kNone = 2 };

struct Params {
  gemm::RowGather x_rows;         // the gate/up tiles' rows: x [T, H] through each row's route,
                                  // stored into copy_to ([C, H], or null) in table order
  const std::int32_t* row_route;  // [C] route t*K + k of each table row, -1 for padding
  const std::int32_t* offsets;    // [El + 1] segment starts
  std::uint16_t* a;               // [C, I]
  std::uint16_t* b;               // [C, I]
  std::uint16_t* h;               // [C, I]
  std::uint16_t* rows_out;        // [T * K, H]
  tasks::Queue* queue;
  int* ready;  // [num_counters] per row tile: consumer warpgroups done with its gate/up tiles
  int num_counters;
  tasks::WaitSite wait;
  int inject;  // > 0: row tile 0's down tasks wait for one arrival that never comes (a test)
  int capacity;
  int num_experts;
  int hidden;
  int inner;
  core::SwigluLimit limit;
  unsigned long long* timers;  // a timed launch's accounts (Timer), else null
  // Across ranks (kRanks; last, so that one rank's kernel reads its parameters where it did):
  // each table row's source rank, and every rank's token rows (bf16 [T_max, H]) and output rows
  // (bf16 [T_max * K, H]) by address. x_rows.rows is then no rank's rows (never read: only the
  // address a zero-filled copy names).
  const std::int32_t* row_src;    // [C]
  const std::int64_t* x_ranks;    // [world_size]
  const std::int64_t* out_ranks;  // [world_size]
  int world_size;
};

// Across ranks: table row r's x row in its source rank's token rows, or null (a padding row, a
// route out of range or a source rank outside [0, world_size): zeros, as one rank's gather).
// (r < the table's rows: the route and the rank are loaded side by side, then the rank's base.)
__device__ inline const std::uint16_t* rank_x_row(const Params& p, int r) {
  const int route = p.row_route[r];
  const int rank = p.row_src[r];
  if (route < 0 || route >= p.x_rows.num_routes || rank < 0 || rank >= p.world_size) return nullptr;
  return reinterpret_cast<const std::uint16_t*>(__ldg(p.x_ranks + rank)) +
         static_cast<std::int64_t>(route / p.x_rows.divisor) * p.hidden;
}

// A timed launch (MoeForwardArgs::timers; kTimed, its own instantiation: the untimed kernel is
// the same code as without timers) adds up clock64 cycles per CTA in three roles, the producer's
// thread 0 and each consumer warpgroup's leader, kTimerSlots accounts each.
enum Timer : int {
  kTimeTicket =
      0,  // waiting for a ticket (producer: a free slot and the atomic; consumers: the slot)
  kTimeGateUp = 1,      // in gate/up tasks (waits included)
  kTimeSwiglu = 2,      // consumers: h at a gate/up tile's end (the element math, the stores)
  kTimeDown = 3,        // in down tasks (waits included)
  kTimeStageWait = 4,   // waiting on a ring stage (producer: empty; consumers: full)
  kTimeDependency = 5,  // waiting on a row tile's counter (the producer, for a down task)
  kTimeFlush = 6,       // consumers: the pending tile's pieces stored all at once
  kTimeTotal = 7,       // the role's time from the start to the end of its task loop
  kTimeTasks = 8,       // tasks taken (a count, not cycles)
  kTimerSlots = 9,
};
constexpr int kTimerRoles = 3;

// Adds `value` to account `slot` of `role` in shared memory (kTimed launches only).
template <bool kTimed>
__device__ inline void account(unsigned long long (*acc)[kTimerSlots], int role, int slot,
                               unsigned long long value) {
  if constexpr (kTimed) atomicAdd(&acc[role][slot], value);
}

// The row tiles of the segments, in shared memory.
struct RowTiles {
  int lo[kMaxExperts];          // segment start (clamped to [0, C])
  int hi[kMaxExperts];          // segment end (>= lo)
  int prefix[kMaxExperts + 1];  // row tiles before expert e
};

struct Task {
  int kind;
  int expert;
  int row0;     // first row of the tile
  int row_end;  // end of the expert's segment
  int col0;     // first output column (of each weight, for gate/up)
  int rt;       // the row tile's counter
  int k_blocks;
};

__device__ inline void build_row_tiles(const Params& p, RowTiles& rt, int lane) {
  const auto clamp = [&](int r) { return r < 0 ? 0 : (r > p.capacity ? p.capacity : r); };
  const int per_lane = (p.num_experts + 31) / 32;
  const int first = lane * per_lane;
  int sum = 0;
  for (int e = first; e < first + per_lane && e < p.num_experts; ++e) {
    const int lo = clamp(p.offsets[e]);
    const int hi = max(lo, clamp(p.offsets[e + 1]));
    rt.lo[e] = lo;
    rt.hi[e] = hi;
    sum += (hi - lo + kBlockM - 1) / kBlockM;
  }
  int before = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xFFFFFFFFu, before, d);
    if (lane >= d) before += v;
  }
  before -= sum;
  for (int e = first; e < first + per_lane && e < p.num_experts; ++e) {
    rt.prefix[e] = before;
    before += (rt.hi[e] - rt.lo[e] + kBlockM - 1) / kBlockM;
  }
  if (lane == 31) rt.prefix[p.num_experts] = before;
}

__device__ inline int gate_up_columns(const Params& p) {
  return (p.inner + kGateUpN - 1) / kGateUpN;
}
__device__ inline int down_columns(const Params& p) { return (p.hidden + kDownN - 1) / kDownN; }

// Task t of the list: every gate/up tile, then every down tile.
__device__ inline Task decode(const Params& p, const RowTiles& rt, unsigned int t) {
  const int row_tiles = rt.prefix[p.num_experts];
  const int n_gate_up = row_tiles * gate_up_columns(p);
  const int n_down = row_tiles * down_columns(p);
  Task task{};
  if (t >= static_cast<unsigned int>(n_gate_up + n_down)) {
    task.kind = kNone;
    return task;
  }
  int local = static_cast<int>(t);
  task.kind = local < n_gate_up ? kGateUp : kDown;
  local -= task.kind == kGateUp ? 0 : n_gate_up;
  const bool gate_up = task.kind == kGateUp;
  const int columns = gate_up ? gate_up_columns(p) : down_columns(p);
  const int block_n = gate_up ? kGateUpN : kDownN;
  int lo = 0, hi = p.num_experts - 1;  // the last expert whose first task is <= local
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (rt.prefix[mid] * columns <= local)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int e = lo;
  local -= rt.prefix[e] * columns;
  const int m_tiles = rt.prefix[e + 1] - rt.prefix[e];
  const int band = local / (kBandTiles * columns);
  const int first = band * kBandTiles;
  const int rows = min(kBandTiles, m_tiles - first);
  const int in_band = local - band * kBandTiles * columns;
  const int tile = first + in_band % rows;
  task.expert = e;
  task.row0 = rt.lo[e] + tile * kBlockM;
  task.row_end = rt.hi[e];
  task.col0 = (in_band / rows) * block_n;
  task.rt = rt.prefix[e] + tile;
  task.k_blocks = gate_up ? p.hidden / kBlockK : p.inner / kBlockK;
  return task;
}

// A tile's rounded results while they are being stored.
struct Pending {
  PackedBf16 words;
  Task task;
  int route[2];  // down tiles: the routes of the thread's two rows (-1: none)
  // ... across ranks: their source ranks (16 bits each, row 0's low; the output rows' address
  // is read from out_ranks in L1 as a piece is stored: two 64-bit addresses held here spilled)
  unsigned int ranks;
  bool live;
};

// Piece kChunk of a pending tile (grouped_gemm.cuh's for_each_vector_in_chunk): 16-byte vectors
// of a and b (gate/up: a's columns are n8 blocks j < 16, b's the rest) or of the routed rows of
// rows_out (down).
template <int kChunk, bool kRanks>
__device__ inline void store_piece(const Params& p, const Pending& pend, int consumer) {
  const Task& task = pend.task;
  if (task.kind == kGateUp) {
    constexpr int kUpBlocks = kGateUpN / 8;
    std::uint16_t* const to = kChunk < kDrainChunks / 2 ? p.a : p.b;
    if (to == nullptr) return;  // no context kept (a forward that no backward follows)
    gemm::for_each_vector_in_chunk<kChunk>(pend.words, [&](int, int r, int j, const uint4& v) {
      const int row = task.row0 + 64 * consumer + r;
      const int col = task.col0 + 8 * (j % kUpBlocks);
      if (row < task.row_end && col < p.inner)
        *reinterpret_cast<uint4*>(to + static_cast<std::int64_t>(row) * p.inner + col) = v;
    });
  } else {
    gemm::for_each_vector_in_chunk<kChunk>(pend.words, [&](int half, int, int j, const uint4& v) {
      const int col = task.col0 + 8 * j;
      const int route = half == 0 ? pend.route[0] : pend.route[1];
      if (route >= 0 && col < p.hidden) {
        std::uint16_t* rows = p.rows_out;
        if constexpr (kRanks) {
          const unsigned int rank = half == 0 ? pend.ranks & 0xffffu : pend.ranks >> 16;
          rows = reinterpret_cast<std::uint16_t*>(__ldg(p.out_ranks + rank));
        }
        *reinterpret_cast<uint4*>(rows + static_cast<std::int64_t>(route) * p.hidden + col) = v;
      }
    });
  }
}

// The warpgroup's stores of a task -> the tasks that wait for the row tile's counter, in other
// CTAs: the barrier gathers the warpgroup, one release bumps the counter.
__device__ inline void signal(const Params& p, const Task& task, int consumer) {
  hopper::named_barrier(kConsumerBarrier + consumer, 128);
  if (threadIdx.x % 128 == 0) tasks::add_release(p.ready + task.rt, 1);
}

// A gate/up tile's h, the warpgroup's 64 rows of it, at the tile's end (swiglu_h_tile.cuh). Then
// the counter: every thread's h stores fenced for the async proxy (the down tiles' copy engine
// reads h), the warpgroup gathered, one release.
__device__ inline void store_h(const Params& p, const Task& task, int consumer, const PackedBf16& w,
                               const core::TableSigmoid& sig) {
  gemm::store_swiglu_h(p.h, p.inner, task.row0 + 64 * consumer, task.row_end, task.col0, w, p.limit,
                       sig);
  tasks::fence_proxy_async_global();
  signal(p, task, consumer);
}

// A role's accounts into the launch's timers: [CTA][role][slot] (the role's own thread, after
// its own last account: its shared-memory atomics are ordered before its reads).
template <bool kTimed>
__device__ inline void write_timers(const Params& p, unsigned long long (*acc)[kTimerSlots],
                                    int role) {
  if constexpr (kTimed) {
    unsigned long long* out = p.timers + (blockIdx.x * kTimerRoles + role) * kTimerSlots;
    for (int s = 0; s < kTimerSlots; ++s) out[s] = atomicAdd(&acc[role][s], 0ull);
  }
}

template <bool kTimed, bool kRanks>
__global__ void __launch_bounds__(kThreads, 1)
    moe_forward_kernel(const __grid_constant__ CUtensorMap map_wg,
                       const __grid_constant__ CUtensorMap map_wu,
                       const __grid_constant__ CUtensorMap map_h,
                       const __grid_constant__ CUtensorMap map_wd,
                       const __grid_constant__ CUtensorMap map_x, Params p) {
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t full[kStages];
  __shared__ alignas(8) std::uint64_t empty[kStages];
  __shared__ alignas(8) std::uint64_t task_full[kTaskSlots];
  __shared__ alignas(8) std::uint64_t task_empty[kTaskSlots];
  __shared__ alignas(8) std::uint64_t lag;  // consumer 0 has issued kLagBlocks k-blocks
  __shared__ unsigned int task_id[kTaskSlots];
  __shared__ int tile_token[kBlockM];  // a gate/up task's rows: their tokens (producer)
  // ... across ranks their x rows, in their source ranks' token rows (null: zeros)
  __shared__ const std::uint16_t* tile_from[kRanks ? kBlockM : 1];
  __shared__ RowTiles row_tiles;
  __shared__ unsigned long long timer_acc[kTimed ? kTimerRoles : 1][kTimerSlots];

  const R ring{hopper::swizzle_base(smem_raw)};
  const hopper::Pipeline<kStages> stages{full, empty};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) build_row_tiles(p, row_tiles, lane);
  if constexpr (kTimed) {
    if (threadIdx.x < kTimerRoles * kTimerSlots) (&timer_acc[0][0])[threadIdx.x] = 0;
  }
  if (threadIdx.x == 32) {
    stages.init(128, 2);  // every producer thread arrives; one arrival per consumer warpgroup
    for (int s = 0; s < kTaskSlots; ++s) {
      hopper::mbar_init(&task_full[s], 1);
      hopper::mbar_init(&task_empty[s], 2);
    }
    hopper::mbar_init(&lag, 1);
    hopper::fence_barrier_init();
  }
  __syncthreads();
  const int gate_up_target = 2 * gate_up_columns(p);  // a row tile's gate/up tiles' h is stored

  if (threadIdx.x < 128) {  // ---------------------------------------------- producer
    Regs::producer();
    const int i = threadIdx.x;
    if (i == 0) {
      hopper::prefetch_tensor_map(&map_wg);
      hopper::prefetch_tensor_map(&map_wu);
      hopper::prefetch_tensor_map(&map_h);
      hopper::prefetch_tensor_map(&map_wd);
      hopper::prefetch_tensor_map(&map_x);
    }
    hopper::RingPos<kStages> pos;  // the ring of stages
    // The task slots' ring position, as two counters: written as a hopper::RingPos, nvcc
    // schedules this producer's code differently (not measured on a GPU; NOTES.md, session 29).
    int slot = 0;
    std::uint32_t slot_phase = 0;
    const long long start = kTimed ? clock64() : 0;
    const bool timer = kTimed && i == 0;  // the producer's accounts: thread 0's
    const auto clock = [&] { return kTimed ? clock64() : 0; };
    for (;;) {
      if (i == 0) {
        const long long t0 = clock();
        hopper::mbar_wait(&task_empty[slot], slot_phase ^ 1);
        task_id[slot] = tasks::take_ticket(p.queue);
        hopper::mbar_arrive(&task_full[slot]);  // release: the ticket -> the consumers' wait
        account<kTimed>(timer_acc, 0, kTimeTicket, clock() - t0);
        account<kTimed>(timer_acc, 0, kTimeTasks, 1);
      }
      hopper::named_barrier(kProducerBarrier, 128);
      const unsigned int t = *static_cast<volatile unsigned int*>(&task_id[slot]);
      if (++slot == kTaskSlots) {
        slot = 0;
        slot_phase ^= 1;
      }
      const Task task = decode(p, row_tiles, t);
      if (task.kind == kNone) break;
      const long long task_start = clock();
      if (task.kind == kGateUp) {
        // The tile's rows: each one's token (whose x row it reads), or -1 (a padding row, or past
        // the segment: zeros).
        const int row = task.row0 + i;
        if constexpr (kRanks) {
          tile_from[i] = row < task.row_end ? rank_x_row(p, row) : nullptr;
        } else {
          tile_token[i] = row < task.row_end ? p.x_rows.source(row) : -1;
        }
        hopper::named_barrier(kProducerBarrier, 128);
        const int b_row = task.expert * p.inner + task.col0;
        for (int kb = 0; kb < task.k_blocks; ++kb) {
          const long long t0 = clock();
          const int stage = stages.acquire(pos);
          if (timer) account<kTimed>(timer_acc, 0, kTimeStageWait, clock() - t0);
          if (i == 0) {
            hopper::mbar_expect_tx_only(&full[stage], R::kBBytes);
            unsigned char* b = ring.b(stage);
            hopper::tma_load_2d(b, &map_wg, &full[stage], kb * kBlockK, b_row);
            hopper::tma_load_2d(b + R::kBBytes / 2, &map_wu, &full[stage], kb * kBlockK, b_row);
          }
          // (The tokens re-read from shared memory: the registers are few.)
          if constexpr (kRanks) {
            gemm::gather_box<kBlockM>(ring.a(stage), p.x_rows, kb * kBlockK, i,
                                      [&](int j) { return tile_from[i / 8 + 16 * j]; });
          } else {
            gemm::gather_box<kBlockM>(ring.a(stage), p.x_rows, kb * kBlockK, i,
                                      [&](int j) { return tile_token[i / 8 + 16 * j]; });
          }
          // The stage's arrival of this thread, once its copies have landed (the barrier's
          // completion makes them visible to the consumers' wgmma, as for the copy engine).
          hopper::cp_async_arrive(&full[stage]);
          pos.advance();
        }
        if (timer) account<kTimed>(timer_acc, 0, kTimeGateUp, clock() - task_start);
      } else {
        if (i == 0) {
          const int extra = p.inject > 0 && task.rt == 0 ? 1 : 0;
          const long long t0 = clock();
          tasks::wait_at_least(p.ready + task.rt, gate_up_target + extra, p.wait);
          account<kTimed>(timer_acc, 0, kTimeDependency, clock() - t0);
          // The acquire above -> the copy engine's reads of h below.
          tasks::fence_proxy_async_global();
        }
        const int b_row = task.expert * p.hidden + task.col0;
        for (int kb = 0; kb < task.k_blocks; ++kb) {
          const long long t0 = clock();
          const int stage = stages.acquire(pos);
          if (timer) account<kTimed>(timer_acc, 0, kTimeStageWait, clock() - t0);
          if (i == 0) {
            hopper::mbar_expect_tx_only(&full[stage], R::kStageBytes);
            hopper::tma_load_2d(ring.a(stage), &map_h, &full[stage], kb * kBlockK, task.row0);
            hopper::tma_load_2d(ring.b(stage), &map_wd, &full[stage], kb * kBlockK, b_row);
          }
          hopper::mbar_arrive(&full[stage]);
          pos.advance();
        }
        if (timer) account<kTimed>(timer_acc, 0, kTimeDown, clock() - task_start);
      }
    }
    if (timer) {
      account<kTimed>(timer_acc, 0, kTimeTotal, clock() - start);
      write_timers<kTimed>(p, timer_acc, 0);
    }
    return;
  }

  // ------------------------------------------------------------------------ consumers
  Regs::consumer();
  const int consumer = threadIdx.x / 128 - 1;  // rows [64 c, 64 c + 64) of a tile
  const bool leader = threadIdx.x % 128 == 0;
  const auto sig = core::TableSigmoid::of(p.limit);
  hopper::RingPos<kTaskSlots> slots;  // the ring of task slots
  bool first_task = true;
  // Consumer 0 lets consumer 1 start after kLagBlocks k-blocks.
  gemm::ConsumerRing<kStages> pipe{stages, &lag, leader, consumer == 0};
  Accumulators acc;
  Pending pend;
  pend.live = false;
  const int role = 1 + consumer;
  const bool timer = kTimed && leader;  // the warpgroup's accounts: its leader's
  const auto clock = [&] { return kTimed ? clock64() : 0; };
  const long long start = clock();

  // A gate/up task of column tile 0 with x_rows.copy_to: the warpgroup's first row (its x each
  // k-block stores from the stage, gemm::store_gathered_rows through map_x), else -1; x_end: the
  // segment's end; x_pending: the leader's last store may still be reading its stage.
  int x_first = -1, x_end = 0;
  bool x_pending = false;
  const auto k_block = [&](int kb) {
    const long long t0 = clock();
    const int stage = pipe.acquire();
    if (timer) account<kTimed>(timer_acc, role, kTimeStageWait, clock() - t0);
    gemm::mma_k_block<0, 0>(acc, hopper::smem_addr(ring.a(stage)) + consumer * 64 * 128,
                            hopper::smem_addr(ring.b(stage)), kb != 0);
    // While the wgmmas run: the stage is this warpgroup's until its release after the next
    // k-block's wgmmas (store_gathered_rows waits for its store's reads before that release).
    gemm::store_gathered_rows(&map_x, p.x_rows, ring.a(stage) + consumer * 64 * 128, x_first, x_end,
                              kb * kBlockK, leader, x_pending);
    pipe.release();
  };
  // Piece kChunk of the pending tile.
  const auto drain = [&](auto chunk) {
    if (!pend.live) return;
    store_piece<chunk.value, kRanks>(p, pend, consumer);
    if constexpr (chunk.value == kDrainChunks - 1) pend.live = false;
  };

  for (;;) {
    const long long t0 = clock();
    slots.wait_full(task_full);
    if (timer) account<kTimed>(timer_acc, role, kTimeTicket, clock() - t0);
    const unsigned int t = *static_cast<volatile unsigned int*>(&task_id[slots.stage]);
    hopper::named_barrier(kConsumerBarrier + consumer, 128);  // every thread has read the slot
    if (leader) hopper::mbar_arrive(&task_empty[slots.stage]);
    slots.advance();
    const Task task = decode(p, row_tiles, t);
    const bool done = task.kind == kNone;
    if (first_task && !done) {  // the first task
      if (consumer == 1) hopper::mbar_wait(&lag, 0);
      first_task = false;
    }
    // The pending tile's pieces go out one after each of this task's first k-blocks, or all of
    // them first (one site in the code: the kernel's size is what its instruction fetch pays for)
    // when no task is left or when this task has fewer k-blocks than pieces. (Two pieces after
    // each k-block of such a task instead measured 2 % slower at sonic-7b: NOTES.md, session 33.)
    const bool flush = pend.live && (done || task.k_blocks < kDrainChunks);
    const long long t1 = clock();
    if (flush) unroll<kDrainChunks>([&](auto c) { drain(c); });
    if (timer && flush) account<kTimed>(timer_acc, role, kTimeFlush, clock() - t1);
    if (done) break;
    if (timer) account<kTimed>(timer_acc, role, kTimeTasks, 1);
    const long long task_start = clock();
    const bool copy_x = p.x_rows.copy_to != nullptr && task.kind == kGateUp && task.col0 == 0;
    x_first = copy_x ? task.row0 + 64 * consumer : -1;
    x_end = task.row_end;
    // A down tile's rows (the thread's two): their routes, and across ranks their source ranks,
    // loaded now, side by side, so that they have landed by the tile's end, where the pending
    // tile takes them (a short task's pieces go out before the next task's first wgmma).
    int route[2] = {-1, -1};
    int src[2] = {-1, -1};
    if (task.kind == kDown) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = task.row0 + 64 * consumer + frag_row(threadIdx.x % 128, 2 * half);
        if (row < task.row_end) {
          route[half] = p.row_route[row];
          if constexpr (kRanks) src[half] = p.row_src[row];
        }
      }
    }
    // The grouped GEMMs' tile loop (no pieces after it: a short task's went out above). At its
    // end consumer 1 is let go if the first task had fewer than kLagBlocks blocks.
    gemm::consume_tile<true, false>(pipe, acc, task.k_blocks, k_block, drain,
                                    [&] { gemm::gathered_rows_read(leader, x_pending); });
    gemm::pack_bf16(acc, pend.words);
    pend.task = task;
    pend.live = true;
    if (timer) {
      account<kTimed>(timer_acc, role, task.kind == kGateUp ? kTimeGateUp : kTimeDown,
                      clock() - task_start);
    }
    if (task.kind == kGateUp) {
      // The accumulators hold nothing now (the next tile's first wgmma does not read them):
      // constants, so that their registers are free for the lookups and the element math.
#pragma unroll
      for (int i = 0; i < kMmaN / 2; ++i) acc.d[i] = 0.0f;
      const long long t2 = clock();
      store_h(p, task, consumer, pend.words, sig);
      if (timer) account<kTimed>(timer_acc, role, kTimeSwiglu, clock() - t2);
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // A route outside [0, T * K) is stored nowhere, as its gather read zeros (RowGather).
        int r = route[half] < p.x_rows.num_routes ? route[half] : -1;
        if constexpr (kRanks) {  // the row's source rank (outside [0, R): stored nowhere)
          const int rank = src[half];
          r = rank >= 0 && rank < p.world_size ? r : -1;
          const unsigned int bits = r >= 0 ? static_cast<unsigned int>(rank) : 0u;
          pend.ranks = half == 0 ? bits : (pend.ranks & 0xffffu) | (bits << 16);
        }
        if (half == 0)
          pend.route[0] = r;
        else
          pend.route[1] = r;
      }
    }
  }
  if (leader) hopper::bulk_wait<0>();  // the copy engine's x stores done before the CTA ends
  if (timer) {
    account<kTimed>(timer_acc, role, kTimeTotal, clock() - start);
    write_timers<kTimed>(p, timer_acc, role);
  }

  // The pre-activations and x rows past the last segment (the capacity's tail) are zeroed, so
  // every byte of a, b and x_out is written by the launch (where they are asked for).
  {
    const int end = p.offsets[p.num_experts];
    const int from = end < 0 ? 0 : (end > p.capacity ? p.capacity : end);
    const std::int64_t vectors = static_cast<std::int64_t>(p.capacity - from) * p.inner / 8;
    const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * 256;
    const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * 256 + (threadIdx.x - 128);
    if (p.a != nullptr) {
      uint4* a = reinterpret_cast<uint4*>(p.a + static_cast<std::int64_t>(from) * p.inner);
      uint4* b = reinterpret_cast<uint4*>(p.b + static_cast<std::int64_t>(from) * p.inner);
      for (std::int64_t v = first; v < vectors; v += step) {
        a[v] = make_uint4(0, 0, 0, 0);
        b[v] = make_uint4(0, 0, 0, 0);
      }
    }
    if (p.x_rows.copy_to != nullptr) {
      const std::int64_t x_vectors = static_cast<std::int64_t>(p.capacity - from) * p.hidden / 8;
      uint4* x =
          reinterpret_cast<uint4*>(p.x_rows.copy_to + static_cast<std::int64_t>(from) * p.hidden);
      for (std::int64_t v = first; v < x_vectors; v += step) x[v] = make_uint4(0, 0, 0, 0);
    }
  }
  tasks::reset_after_last_cta(p.queue, p.ready, p.num_counters, 128, 256, kConsumersBarrier);
}

// One instantiation's launch over `sms` CTAs, its shared memory allowed first.
template <bool kTimed, bool kRanks>
void launch_kernel(int sms, cudaStream_t stream, const CUtensorMap& map_wg,
                   const CUtensorMap& map_wu, const CUtensorMap& map_h, const CUtensorMap& map_wd,
                   const CUtensorMap& map_x, const Params& p) {
  kernels::allow_shared_bytes<moe_forward_kernel<kTimed, kRanks>>(R::kSharedBytes);
  moe_forward_kernel<kTimed, kRanks>
      <<<sms, kThreads, R::kSharedBytes, stream>>>(map_wg, map_wu, map_h, map_wd, map_x, p);
}

}  // namespace

void moe_forward_cuda(const MoeForwardArgs& args, std::uintptr_t stream_handle) {
  const ExpertShape& s = args.shape;
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int sms = args.num_sms > 0 ? static_cast<int>(args.num_sms) : kernels::device_sms();
  const auto ptr = [](std::uintptr_t v) { return reinterpret_cast<const void*>(v); };
  const std::uint64_t C = static_cast<std::uint64_t>(s.num_rows);
  const std::uint64_t H = static_cast<std::uint64_t>(s.hidden);
  const std::uint64_t I = static_cast<std::uint64_t>(s.inner);
  const std::uint64_t El = static_cast<std::uint64_t>(s.num_experts);
  const CUtensorMap map_wg = hopper::make_tensor_map(ptr(args.w_gate), El * I, H, kGateUpN);
  const CUtensorMap map_wu = hopper::make_tensor_map(ptr(args.w_up), El * I, H, kGateUpN);
  const CUtensorMap map_h = hopper::make_tensor_map(ptr(args.scratch_h), C, I, kBlockM);
  const CUtensorMap map_wd = hopper::make_tensor_map(ptr(args.w_down), El * H, I, kDownN);
  // The x rows' table-ordered copy, stored by the copy engine in 64-row boxes (map_h stands in
  // for it, never used, when there is none).
  const CUtensorMap map_x =
      args.out_x != 0 ? hopper::make_tensor_map(ptr(args.out_x), C, H, 64) : map_h;
  const bool ranks = args.world_size > 1;
  Params p{};
  p.row_route = reinterpret_cast<const std::int32_t*>(args.row_route);
  // (across ranks the gather's zero-filled copies name row_src's address: a valid one, never read)
  p.x_rows = {reinterpret_cast<const std::uint16_t*>(ranks ? args.row_src : args.x),
              p.row_route,
              s.num_rows,
              static_cast<int>(args.num_tokens * args.topk),
              static_cast<int>(args.topk),
              static_cast<int>(s.hidden),
              reinterpret_cast<std::uint16_t*>(args.out_x)};
  p.offsets = reinterpret_cast<const std::int32_t*>(args.offsets);
  p.a = reinterpret_cast<std::uint16_t*>(args.out_a);
  p.b = reinterpret_cast<std::uint16_t*>(args.out_b);
  p.h = reinterpret_cast<std::uint16_t*>(args.scratch_h);
  p.rows_out = reinterpret_cast<std::uint16_t*>(args.out_rows);
  p.queue = reinterpret_cast<tasks::Queue*>(args.task_state);
  p.ready = reinterpret_cast<int*>(args.task_state + sizeof(tasks::Queue));
  p.num_counters = static_cast<int>(moe_forward_counters(s.num_rows, s.num_experts));
  p.wait = {reinterpret_cast<std::int32_t*>(args.error), static_cast<std::int32_t>(args.stage),
            static_cast<std::int32_t>(args.rank), args.timeout_ns};
  p.inject = args.inject_missing_dependency ? 1 : 0;
  p.capacity = static_cast<int>(s.num_rows);
  p.num_experts = static_cast<int>(s.num_experts);
  p.hidden = static_cast<int>(s.hidden);
  p.inner = static_cast<int>(s.inner);
  p.limit = args.limit;
  p.timers = reinterpret_cast<unsigned long long*>(args.timers);
  p.row_src = reinterpret_cast<const std::int32_t*>(args.row_src);
  p.x_ranks = reinterpret_cast<const std::int64_t*>(args.x_ranks);
  p.out_ranks = reinterpret_cast<const std::int64_t*>(args.out_rows_ranks);
  p.world_size = static_cast<int>(args.world_size);
  core::ensure_sigmoid_table(stream);
  // (a timed launch is one rank's: the caller refuses timers across ranks)
  const auto launch = args.timers != 0 ? launch_kernel<true, false>
                      : ranks          ? launch_kernel<false, true>
                                       : launch_kernel<false, false>;
  launch(sms, stream, map_wg, map_wu, map_h, map_wd, map_x, p);
  kernels::check(cudaGetLastError(), "launching the forward megakernel");
}

}  // namespace mok::bf16::sm90
