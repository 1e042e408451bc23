// CUDA builds of the schedule table and the send side (docs/core-runtime.md "Schedule").
//
// Both are stable counting sorts of routes into buckets (a local expert; a send bucket), run by
// one CTA that reads every count from device memory, so the host never waits. One CTA keeps
// the sort order a plain consequence of program order: routes are ranked chunk after chunk,
// each chunk's ranks start where the previous chunk's ended, and no float is ever touched.
// Integer atomics only add counts of disjoint route groups, so their order changes nothing.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "device_kind.h"
#include "mok/core/schedule.h"
#include "mok/core/transport.h"
#include "schedule_impl.h"

namespace mok::core {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxWarps = 32;
// Routes per lane per chunk of the ranking pass: each lane keeps its chunk's keys and
// match masks in registers, so a chunk costs two CTA barriers for kRounds * blockDim routes.
constexpr int kRounds = 8;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }

__device__ __forceinline__ int warp_inclusive_scan(int v) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(kFullMask, v, d);
    if (lane_id() >= d) v += u;
  }
  return v;
}

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

// counts[b] += the routes i < n with key_of(i) == b (b < num_buckets); other keys are skipped.
// Lanes of a warp with the same key add their count once (one shared atomic per group).
template <class KeyFn>
__device__ void count_buckets(std::int64_t n, int num_buckets, int* counts, KeyFn key_of) {
  for (std::int64_t base = 0; base < n; base += blockDim.x) {
    const std::int64_t i = base + threadIdx.x;
    const int key = i < n ? key_of(i) : num_buckets;
    const unsigned peers = __match_any_sync(kFullMask, key);
    if (key < num_buckets && lane_id() == __ffs(peers) - 1) atomicAdd(&counts[key], __popc(peers));
  }
}

// Exclusive prefix sum of weight(counts[b]) over b < num_buckets, in place, by warp 0 (the
// caller syncs); visit(b, count, start) sees each bucket. Returns the total on warp 0.
template <class WeightFn, class VisitFn>
__device__ int bucket_starts(int* counts, int num_buckets, WeightFn weight, VisitFn visit) {
  int carry = 0;
  for (int b0 = 0; b0 < num_buckets; b0 += 32) {
    const int b = b0 + lane_id();
    const int count = b < num_buckets ? counts[b] : 0;
    const int w = b < num_buckets ? weight(count) : 0;
    const int incl = warp_inclusive_scan(w);
    if (b < num_buckets) {
      counts[b] = carry + incl - w;
      visit(b, count, carry + incl - w);
    }
    carry += __shfl_sync(kFullMask, incl, 31);
  }
  return carry;
}

// The ranking pass: emit(i, b, position) for every route i < n with key b = key_of(i) <
// num_buckets, where position = next[b] + (routes before i with key b); next[b] advances.
//
// Chunk of blockDim * kRounds routes: warp w owns the contiguous slice [w*32*kRounds, ...),
// lane l rounds j at w*32*kRounds + 32*j + l, so (warp, round, lane) order is route order.
//   1. each round: __match_any_sync groups the lanes with equal keys; the group's leader adds
//      the group size to warp_rows[w][b]  (per-warp counts of this chunk);
//   -- __syncthreads --
//   2. warp v scans buckets b = v, v+W, ...: lane l turns warp_rows[l][b] into warp l's first
//      position of b (next[b] + counts of warps < l); next[b] += the chunk's count of b;
//   -- __syncthreads --
//   3. each round again: the leader's atomicAdd on warp_rows[w][b] returns the group's first
//      position (and moves it past the group); a lane adds the popc of its group's lower lanes.
//      Then each warp zeroes the entries it used (only its own row, so only __syncwarp).
// The invariant between chunks: warp_rows is all zero (step 2 writes only nonzero counts).
// Rounds of one warp are ordered by the __shfl_sync each round ends with, so two leaders of
// the same bucket in consecutive rounds take their positions in round order.
template <class KeyFn, class EmitFn>
__device__ void rank_and_emit(std::int64_t n, int num_buckets, int* warp_rows, int stride,
                              int* next, KeyFn key_of, EmitFn emit) {
  const int num_warps = static_cast<int>(blockDim.x >> 5);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int lane = lane_id();
  const unsigned lanes_below = (1u << lane) - 1u;
  int* mine = warp_rows + warp * stride;
  const std::int64_t chunk = static_cast<std::int64_t>(blockDim.x) * kRounds;
  for (std::int64_t base = 0; base < n; base += chunk) {
    const std::int64_t first = base + static_cast<std::int64_t>(warp) * 32 * kRounds + lane;
    int key[kRounds];
    unsigned peers[kRounds];
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      const std::int64_t i = first + 32 * j;
      key[j] = i < n ? key_of(i) : num_buckets;
      peers[j] = __match_any_sync(kFullMask, key[j]);
      if (key[j] < num_buckets && lane == __ffs(peers[j]) - 1) {
        atomicAdd(&mine[key[j]], __popc(peers[j]));
      }
    }
    __syncthreads();
    for (int b = warp; b < num_buckets; b += num_warps) {
      const int count = lane < num_warps ? warp_rows[lane * stride + b] : 0;
      const int start = next[b];
      const int incl = warp_inclusive_scan(count);
      if (count != 0) warp_rows[lane * stride + b] = start + incl - count;
      __syncwarp();  // every lane read next[b] before lane 31 moves it
      if (lane == 31) next[b] = start + incl;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      const int leader = __ffs(peers[j]) - 1;
      int position = 0;
      if (key[j] < num_buckets && lane == leader) {
        position = atomicAdd(&mine[key[j]], __popc(peers[j]));
      }
      position = __shfl_sync(kFullMask, position, leader);
      if (key[j] < num_buckets)
        emit(first + 32 * j, key[j], position + __popc(peers[j] & lanes_below));
    }
    __syncwarp();  // the last round's atomics before the zeroing stores
#pragma unroll
    for (int j = 0; j < kRounds; ++j) {
      if (key[j] < num_buckets) mine[key[j]] = 0;
    }
    __syncwarp();  // the zeroing before the next chunk's counting atomics
  }
}

struct TableParams {
  RouteSource src;  // the routes, token counts and route rows of each source rank
  int world_size;
  int max_tokens;
  int topk;
  int rank;
  int num_local_experts;
  int alignment;
  int stride;  // of warp_rows, odd so that step 2's column reads hit 32 banks
  std::int64_t capacity;
  std::int32_t* row_src_rank;
  std::int32_t* row_route;
  std::int32_t* expert_offsets;
  std::int32_t* expert_counts;
  std::int64_t* recv_counts;
  std::int64_t* tokens_per_rank;
  std::int32_t* error;  // the transport's error words, or null
};

// Route i of source s has expert id `id`; one outside [0, R * El) is recorded in the error words
// (schedule.h, bad_expert_word): the largest word is the first such route, whichever thread sees
// it first. Called by the table's counting pass, once per route.
__device__ __forceinline__ void check_expert_id(const TableParams& p, int s, std::int64_t i,
                                                std::int32_t id) {
  const std::int64_t E = static_cast<std::int64_t>(p.world_size) * p.num_local_experts;
  if ((id >= 0 && id < E) || p.error == nullptr) return;
  using namespace transport;
  const int was = atomicCAS(p.error + kErrorCode, 0, kErrorBadExpert);
  if (was != 0 && was != kErrorBadExpert) return;  // another error came first: it stays
  const std::int64_t flat = static_cast<std::int64_t>(s) * p.max_tokens * p.topk + i;
  atomicMax(reinterpret_cast<unsigned long long*>(p.error + kErrorStage),
            static_cast<unsigned long long>(bad_expert_word(flat, id)));
}

// The schedule table of one rank, one CTA of W warps (W <= 32, from the shared memory the
// buckets need). Shared memory: warp_rows [W][stride], next [El], one scratch counter.
//   pass 1, per source rank s: count its routes per local expert (count_buckets) and the ones
//     to this rank (recv_counts[s], a CTA sum);
//   warp 0: counts -> aligned segment offsets (bucket_starts), written out; next[e] = offset;
//   pass 2, per source rank s in order: rank_and_emit places each local route at
//     next[e]++, carrying next across sources, so each segment is in (s, t, k) order.
// The rows are all -1 beforehand (cudaMemsetAsync on the same stream); pass 2 writes the rest.
__global__ void __launch_bounds__(1024) schedule_table_kernel(TableParams p) {
  extern __shared__ int smem[];
  const int El = p.num_local_experts;
  const int num_warps = static_cast<int>(blockDim.x >> 5);
  int* warp_rows = smem;
  int* next = warp_rows + num_warps * p.stride;
  int* scratch = next + El;
  for (int i = threadIdx.x; i < num_warps * p.stride + El + 1; i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const auto num_routes = [&](int s) {
    return clamp_tokens(p.src.tokens(s), p.max_tokens) * p.topk;
  };

  for (int s = 0; s < p.world_size; ++s) {
    int to_me = 0;
    count_buckets(num_routes(s), El, next, [&](std::int64_t i) {
      const std::int32_t id = p.src.id(s, i);
      p.src.copy_id(i, id);
      check_expert_id(p, s, i, id);
      const int e = local_expert(id, p.rank, El);
      if (e == El) p.src.no_row(i);
      to_me += e < El;
      return e;
    });
    to_me = warp_sum(to_me);
    if (lane_id() == 0 && to_me != 0) atomicAdd(scratch, to_me);
    __syncthreads();
    if (threadIdx.x == 0) {
      p.recv_counts[s] = *scratch;
      p.tokens_per_rank[s] = p.src.tokens(s);
      *scratch = 0;
    }
    __syncthreads();
  }

  if (threadIdx.x < 32) {
    const int rows = bucket_starts(
        next, El, [&](int count) { return static_cast<int>(align_up(count, p.alignment)); },
        [&](int e, int count, int start) {
          p.expert_counts[e] = count;
          p.expert_offsets[e] = start;
        });
    if (threadIdx.x == 0) p.expert_offsets[El] = rows;
  }
  __syncthreads();

  for (int s = 0; s < p.world_size; ++s) {
    std::int32_t* route_rows = p.src.route_rows(s);
    rank_and_emit(
        num_routes(s), El, warp_rows, p.stride, next,
        [&](std::int64_t i) { return local_expert(p.src.id(s, i), p.rank, El); },
        [&](std::int64_t i, int /*e*/, int row) {
          p.row_src_rank[row] = s;
          p.row_route[row] = static_cast<std::int32_t>(i);
          if (route_rows != nullptr) route_rows[i] = row;
        });
  }
}

struct SendParams {
  const std::int32_t* top_experts;
  std::int64_t num_routes;
  int num_local_experts;
  int world_size;
  int stride;
  std::int64_t* send_order;
  std::int64_t* send_counts;
};

// The send side, one CTA: the same two passes over this rank's routes with the send buckets
// of schedule.h (ids < 0, experts 0..E-1, ids >= E). send_counts[r] is the span of rank r's
// expert buckets after the scan; pass 2 writes each route index at its bucket's next slot.
__global__ void __launch_bounds__(1024) send_side_kernel(SendParams p) {
  extern __shared__ int smem[];
  const int E = p.num_local_experts * p.world_size;
  const int num_buckets = E + 2;
  const int num_warps = static_cast<int>(blockDim.x >> 5);
  int* warp_rows = smem;
  int* next = warp_rows + num_warps * p.stride;
  for (int i = threadIdx.x; i < num_warps * p.stride + num_buckets; i += blockDim.x) smem[i] = 0;
  __syncthreads();

  const auto key_of = [&](std::int64_t i) { return send_bucket(p.top_experts[i], E); };
  count_buckets(p.num_routes, num_buckets, next, key_of);
  __syncthreads();
  if (threadIdx.x < 32) {
    bucket_starts(next, num_buckets, [](int count) { return count; }, [](int, int, int) {});
  }
  __syncthreads();
  // Read before rank_and_emit moves next[] (that happens only after its first barrier).
  for (int r = threadIdx.x; r < p.world_size; r += blockDim.x) {
    p.send_counts[r] = next[1 + (r + 1) * p.num_local_experts] - next[1 + r * p.num_local_experts];
  }
  rank_and_emit(p.num_routes, num_buckets, warp_rows, p.stride, next, key_of,
                [&](std::int64_t i, int /*b*/, int position) { p.send_order[position] = i; });
}

// ------------------------------------------------------------------ the multi-CTA build
//
// The same stable counting sorts with one CTA per chunk of kSortChunkRoutes routes of a source
// (chunk c of source s is CTA s * chunks + c), in two kernels:
//   sort_count_kernel: the chunk's keys counted per bucket (count_buckets) into
//     scratch[chunk][bucket];
//   sort_emit_kernel: every CTA reads the whole count matrix: per bucket the total (the bucket
//     starts, scanned by warp 0 as bucket_starts does) and the counts of the chunks before its own,
//     which is where its routes of that bucket begin; rank_and_emit then places its chunk's routes
//     in order. A route's position is the same integer sum the one-CTA build computes, so the
//     outputs are the same bits. The emit kernel also writes what the one-CTA build leaves to a
//     memset (the table's padding rows) and the per-bucket outputs (CTA 0).
constexpr int kSortThreads = 256;
constexpr int kSortWarps = kSortThreads / 32;
static_assert(kSortThreads * kRounds == kSortChunkRoutes, "one rank_and_emit pass per chunk");

// The table's sort: local experts as buckets; sources are the ranks.
struct TableSort {
  TableParams p;
  int chunks;  // per source

  __device__ int num_buckets() const { return p.num_local_experts; }
  __device__ int num_sources() const { return p.world_size; }
  __device__ std::int64_t num_routes(int s) const {
    return clamp_tokens(p.src.tokens(s), p.max_tokens) * p.topk;
  }
  __device__ int key(int s, std::int64_t i) const {
    return local_expert(p.src.id(s, i), p.rank, p.num_local_experts);
  }
  // The key in the counting pass, which also checks the id.
  __device__ int count_key(int s, std::int64_t i) const {
    const std::int32_t id = p.src.id(s, i);
    p.src.copy_id(i, id);
    check_expert_id(p, s, i, id);
    const int e = local_expert(id, p.rank, p.num_local_experts);
    if (e == p.num_local_experts) p.src.no_row(i);
    return e;
  }
  __device__ int weight(int count) const { return static_cast<int>(align_up(count, p.alignment)); }
  __device__ void emit(int s, std::int64_t i, int row) const {
    p.row_src_rank[row] = s;
    p.row_route[row] = static_cast<std::int32_t>(i);
    if (std::int32_t* route_rows = p.src.route_rows(s); route_rows != nullptr) route_rows[i] = row;
  }
  // start[b], total[b]: the bucket's first row and its routes; rows in use: `rows`.
  __device__ void finish(const int* start, const int* total, int rows, const int* counts) const {
    const int El = p.num_local_experts;
    // Padding rows (each segment's tail and the capacity's) are -1: spread over every CTA.
    for (int e = blockIdx.x; e < El; e += gridDim.x) {
      const int end = e + 1 < El ? start[e + 1] : rows;
      for (int r = start[e] + total[e] + static_cast<int>(threadIdx.x); r < end; r += blockDim.x) {
        p.row_src_rank[r] = -1;
        p.row_route[r] = -1;
      }
    }
    for (std::int64_t r = rows + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         r < p.capacity; r += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      p.row_src_rank[r] = -1;
      p.row_route[r] = -1;
    }
    if (blockIdx.x != 0) return;
    for (int e = threadIdx.x; e < El; e += blockDim.x) {
      p.expert_offsets[e] = start[e];
      p.expert_counts[e] = total[e];
    }
    if (threadIdx.x == 0) p.expert_offsets[El] = rows;
    // recv_counts[s]: the routes of source s to this rank, summed over its chunks (one warp each).
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int s = warp; s < p.world_size; s += blockDim.x / 32) {
      std::int64_t sum = 0;
      for (std::int64_t i = lane; i < static_cast<std::int64_t>(chunks) * El; i += 32) {
        sum += counts[(static_cast<std::int64_t>(s) * chunks) * El + i];
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(kFullMask, sum, d);
      if (lane == 0) {
        p.recv_counts[s] = sum;
        p.tokens_per_rank[s] = p.src.tokens(s);
      }
    }
  }
};

// The send side's sort: one source (this rank), the send buckets of schedule.h.
struct SendSort {
  SendParams p;
  int chunks;

  __device__ int num_buckets() const { return p.num_local_experts * p.world_size + 2; }
  __device__ int num_sources() const { return 1; }
  __device__ std::int64_t num_routes(int) const { return p.num_routes; }
  __device__ int key(int, std::int64_t i) const {
    return send_bucket(p.top_experts[i], p.num_local_experts * p.world_size);
  }
  __device__ int count_key(int s, std::int64_t i) const { return key(s, i); }
  __device__ int weight(int count) const { return count; }
  __device__ void emit(int, std::int64_t i, int position) const { p.send_order[position] = i; }
  __device__ void finish(const int* start, const int*, int, const int*) const {
    if (blockIdx.x != 0) return;
    for (int r = threadIdx.x; r < p.world_size; r += blockDim.x) {
      p.send_counts[r] =
          start[1 + (r + 1) * p.num_local_experts] - start[1 + r * p.num_local_experts];
    }
  }
};

template <class Sort>
__global__ void __launch_bounds__(kSortThreads)
    sort_count_kernel(Sort sort, int chunks, int* counts) {
  extern __shared__ int hist[];
  const int B = sort.num_buckets();
  const int s = blockIdx.x / chunks;
  const std::int64_t lo = static_cast<std::int64_t>(blockIdx.x % chunks) * kSortChunkRoutes;
  const std::int64_t n = sort.num_routes(s);
  const std::int64_t m = lo < n ? (n - lo < kSortChunkRoutes ? n - lo : kSortChunkRoutes) : 0;
  for (int b = threadIdx.x; b < B; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  count_buckets(m, B, hist, [&](std::int64_t i) { return sort.count_key(s, lo + i); });
  __syncthreads();
  for (int b = threadIdx.x; b < B; b += blockDim.x) {
    counts[static_cast<std::int64_t>(blockIdx.x) * B + b] = hist[b];
  }
}

// Shared memory: warp_rows [kSortWarps][stride], next [B], start [B], total [B].
template <class Sort>
__global__ void __launch_bounds__(kSortThreads)
    sort_emit_kernel(Sort sort, int chunks, int stride, const int* counts) {
  extern __shared__ int smem[];
  const int B = sort.num_buckets();
  int* warp_rows = smem;
  int* next = warp_rows + kSortWarps * stride;
  int* start = next + B;
  int* total = start + B;
  const int me = blockIdx.x;
  const int s = me / chunks;
  const std::int64_t lo = static_cast<std::int64_t>(me % chunks) * kSortChunkRoutes;
  const std::int64_t n = sort.num_routes(s);
  const std::int64_t m = lo < n ? (n - lo < kSortChunkRoutes ? n - lo : kSortChunkRoutes) : 0;
  for (int i = threadIdx.x; i < kSortWarps * stride; i += blockDim.x) warp_rows[i] = 0;
  // Per bucket: every chunk's count (the total) and the earlier chunks' (where ours begin).
  const int all = sort.num_sources() * chunks;
  for (int b = threadIdx.x; b < B; b += blockDim.x) {
    int sum = 0, before = 0;
    constexpr int kUnroll = 8;
    for (int c0 = 0; c0 < all; c0 += kUnroll) {
      int v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        v[u] = c0 + u < all ? counts[static_cast<std::int64_t>(c0 + u) * B + b] : 0;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        sum += v[u];
        if (c0 + u < me) before += v[u];
      }
    }
    total[b] = sum;
    start[b] = sum;
    next[b] = before;
  }
  __syncthreads();
  __shared__ int rows;
  if (threadIdx.x < 32) {
    const int used = bucket_starts(
        start, B, [&](int count) { return sort.weight(count); }, [](int, int, int) {});
    if (threadIdx.x == 0) rows = used;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < B; b += blockDim.x) next[b] += start[b];
  __syncthreads();
  rank_and_emit(
      m, B, warp_rows, stride, next, [&](std::int64_t i) { return sort.key(s, lo + i); },
      [&](std::int64_t i, int, int position) { sort.emit(s, lo + i, position); });
  sort.finish(start, total, rows, counts);
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so it does not surface elsewhere
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status));
  }
}

// Warps and dynamic shared memory for a one-CTA counting sort of num_buckets buckets: as many
// warps (<= 32) as the device's per-block shared memory holds rows of counts for.
struct SortLaunch {
  int warps;
  int stride;
  std::size_t smem_bytes;
};

SortLaunch sort_launch(const char* fn, const char* what, std::int64_t num_buckets,
                       std::int64_t extra_ints) {
  int device = 0;
  int optin = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  const std::int64_t stride = num_buckets | 1;
  const std::int64_t fixed = (num_buckets + extra_ints) * 4;
  const std::int64_t per_warp = stride * 4;
  const std::int64_t warps = (static_cast<std::int64_t>(optin) - fixed) / per_warp;
  if (warps < 1) {
    const std::int64_t max_buckets = (static_cast<std::int64_t>(optin) / 4 - extra_ints - 1) / 2;
    invalid_argument(fn, std::string(what) + " is too large for the CUDA build on this device (" +
                             std::to_string(optin) + " bytes of shared memory per block hold " +
                             std::to_string(max_buckets) + " buckets; it needs " +
                             std::to_string(num_buckets) + ")");
  }
  SortLaunch launch;
  launch.warps = static_cast<int>(warps < kMaxWarps ? warps : kMaxWarps);
  launch.stride = static_cast<int>(stride);
  launch.smem_bytes = static_cast<std::size_t>(fixed + launch.warps * per_warp);
  return launch;
}

template <class Kernel>
void set_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)),
               "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
}

// The two kernels of the multi-CTA sort on `stream`; false (nothing launched) when the emit
// kernel's shared memory exceeds what a CTA of this device may have.
template <class Sort>
bool launch_multi_cta_sort(const Sort& sort, int num_sources, int chunks, int num_buckets,
                           int* scratch, cudaStream_t stream) {
  const int stride = num_buckets | 1;
  const std::size_t count_smem = static_cast<std::size_t>(num_buckets) * 4;
  const std::size_t emit_smem =
      (static_cast<std::size_t>(kSortWarps) * stride + 3 * static_cast<std::size_t>(num_buckets)) *
      4;
  int device = 0, optin = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  if (emit_smem + 64 > static_cast<std::size_t>(optin)) return false;
  const int grid = num_sources * chunks;
  if (grid == 0) return false;
  set_smem(sort_count_kernel<Sort>, count_smem);
  set_smem(sort_emit_kernel<Sort>, emit_smem);
  sort_count_kernel<Sort><<<grid, kSortThreads, count_smem, stream>>>(sort, chunks, scratch);
  check_cuda(cudaGetLastError(), "sort_count_kernel launch");
  sort_emit_kernel<Sort><<<grid, kSortThreads, emit_smem, stream>>>(sort, chunks, stride, scratch);
  check_cuda(cudaGetLastError(), "sort_emit_kernel launch");
  return true;
}

}  // namespace

void build_table_cuda(const TableArgs& a, std::uintptr_t stream_handle) {
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  TableParams p;
  p.src = route_source(a);
  p.world_size = static_cast<int>(a.world_size);
  p.max_tokens = static_cast<int>(a.max_tokens);
  p.topk = static_cast<int>(a.topk);
  p.rank = static_cast<int>(a.rank);
  p.num_local_experts = static_cast<int>(a.num_local_experts);
  p.alignment = static_cast<int>(a.alignment);
  p.capacity = a.capacity;
  p.row_src_rank = reinterpret_cast<std::int32_t*>(a.row_src_rank);
  p.row_route = reinterpret_cast<std::int32_t*>(a.row_route);
  p.expert_offsets = reinterpret_cast<std::int32_t*>(a.expert_offsets);
  p.expert_counts = reinterpret_cast<std::int32_t*>(a.expert_counts);
  p.recv_counts = reinterpret_cast<std::int64_t*>(a.recv_counts);
  p.tokens_per_rank = reinterpret_cast<std::int64_t*>(a.tokens_per_rank);
  p.error = reinterpret_cast<std::int32_t*>(a.error);
  if (a.scratch != 0) {
    const std::int64_t routes = a.max_tokens * a.topk;
    const int chunks = static_cast<int>((routes + kSortChunkRoutes - 1) / kSortChunkRoutes);
    p.stride = 0;
    const TableSort sort{p, chunks};
    if (launch_multi_cta_sort(sort, p.world_size, chunks, p.num_local_experts,
                              reinterpret_cast<int*>(a.scratch), stream)) {
      return;
    }
  }
  const SortLaunch launch =
      sort_launch("build_table", "num_local_experts", a.num_local_experts, /*extra_ints=*/1);
  if (a.capacity > 0) {
    // 0xFF bytes: every row -1 (padding) until the kernel writes the routes.
    const std::size_t bytes = static_cast<std::size_t>(a.capacity) * sizeof(std::int32_t);
    check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(a.row_src_rank), 0xFF, bytes, stream),
               "cudaMemsetAsync(row_src_rank)");
    check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(a.row_route), 0xFF, bytes, stream),
               "cudaMemsetAsync(row_route)");
  }
  p.stride = launch.stride;
  set_smem(schedule_table_kernel, launch.smem_bytes);
  schedule_table_kernel<<<1, launch.warps * 32, launch.smem_bytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "schedule_table_kernel launch");
}

void build_send_side_cuda(const SendSideArgs& a, std::uintptr_t stream_handle) {
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const std::int64_t num_buckets = a.world_size * a.num_local_experts + 2;
  SendParams p;
  p.top_experts = reinterpret_cast<const std::int32_t*>(a.top_experts);
  p.num_routes = a.num_tokens * a.topk;
  p.num_local_experts = static_cast<int>(a.num_local_experts);
  p.world_size = static_cast<int>(a.world_size);
  p.send_order = reinterpret_cast<std::int64_t*>(a.send_order);
  p.send_counts = reinterpret_cast<std::int64_t*>(a.send_counts);
  if (a.scratch != 0) {
    const int chunks = static_cast<int>((p.num_routes + kSortChunkRoutes - 1) / kSortChunkRoutes);
    p.stride = 0;
    const SendSort sort{p, chunks};
    if (launch_multi_cta_sort(sort, 1, chunks, static_cast<int>(num_buckets),
                              reinterpret_cast<int*>(a.scratch), stream)) {
      return;
    }
  }
  const SortLaunch launch = sort_launch("build_send_side", "world_size * num_local_experts",
                                        num_buckets, /*extra_ints=*/0);
  p.stride = launch.stride;
  set_smem(send_side_kernel, launch.smem_bytes);
  send_side_kernel<<<1, launch.warps * 32, launch.smem_bytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "send_side_kernel launch");
}

}  // namespace mok::core
