// The transport protocol of mok-core (docs/core-runtime.md, "Transport"; docs/design.md §7), shared
// by the CPU and CUDA backends: which bytes each schedule-table row moves, how the work is split,
// the epoch barrier over signal pads, and the error words a timed-out wait leaves behind.
//
// Everything here is `MOK_HD` (or a template of it) so the CPU backend, the CUDA kernels of
// mok-core and the fused kernels of the precision packages run the very same protocol. The
// device-only primitives (system-scope release/acquire, %globaltimer, the warp row copy) follow
// at the end, under __CUDACC__.
//
// Pointers arrive as integers (a Python int, a tensor's data_ptr()). An *array of pointers* holds
// one int64 address per rank: rank r's rows (pull), results buffer (push) or signal pad (barrier).
#pragma once

#include <cstdint>

#include "mok/core/hd.h"

namespace mok::core::transport {

// ---------------------------------------------------------------------------------------------
// Error words: `error` is int32 [kErrorWords], all zero until a wait gives up. The code is
// written last, with release semantics, so a reader that sees it set (acquire) sees the rest.
// A set code is sticky: later barriers still arrive but never wait (nothing hangs).
inline constexpr int kErrorWords = 4;
inline constexpr int kErrorCode = 0;   // 0 = no error, else one of the kError* codes below
inline constexpr int kErrorPeer = 1;   // the lowest rank missing at the deadline, or out of step
inline constexpr int kErrorStage = 2;  // the caller's stage (its barrier tag) where it gave up
inline constexpr int kErrorRank = 3;   // the rank that gave up
inline constexpr std::int32_t kErrorTimeout = 1;    // a peer did not arrive within timeout_ns
inline constexpr std::int32_t kErrorOutOfStep = 2;  // a peer arrived at another barrier
// The schedule table met an expert id outside [0, E) (schedule.h, bad_expert_word): words
// kErrorStage and kErrorRank then hold, as one little-endian uint64, which route and which id.
inline constexpr std::int32_t kErrorBadExpert = 3;

// The most workers (CPU threads, CUDA CTAs) one row move may use: far above the SMs of any GPU
// and the cores of any host we run on; a larger value is a caller's bug, refused up front.
inline constexpr std::int64_t kMaxWorkers = 1024;

// Rank r's base address in an array of per-rank pointers.
MOK_HD inline unsigned char* rank_base(const std::int64_t* ptrs, std::int32_t r) {
  return reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(ptrs[r]));
}

// ---------------------------------------------------------------------------------------------
// Row moves over the schedule table (row_src_rank[i] = -1 marks a padding row).

// A pull: table row i <- src_ptrs[row_src_rank[i]] + (row_route[i] / route_divisor) * src_stride,
// padding rows zero-filled. route_divisor = K pulls token rows (x, dy), 1 pulls route rows.
struct PullRows {
  unsigned char* dst;
  const std::int64_t* src_ptrs;
  const std::int32_t* row_src_rank;
  const std::int32_t* row_route;
  std::int64_t capacity;
  std::int64_t route_divisor;
  std::int64_t row_bytes;
  std::int64_t src_stride;
  std::int64_t dst_stride;

  MOK_HD unsigned char* dst_row(std::int64_t i) const { return dst + i * dst_stride; }
  // nullptr for a padding row, or a route without a row (-1: a route no table lists).
  MOK_HD const unsigned char* src_row(std::int64_t i) const {
    const std::int32_t s = row_src_rank[i];
    if (s < 0 || row_route[i] < 0) return nullptr;
    return rank_base(src_ptrs, s) +
           static_cast<std::int64_t>(row_route[i]) / route_divisor * src_stride;
  }
};

// A push: row i / src_divisor of src -> dst_ptrs[row_src_rank[i]] + row_route[i] * dst_stride,
// one destination row per route (nothing summed in flight); padding rows are skipped.
// src_divisor = 1 pushes table rows (an expert rank's outputs, each to its route); K pushes token
// rows to every route of the token (a source rank's x or dy, each to its rows in the expert
// ranks' tables: the push dispatch). With `dst_local` instead of dst_ptrs the destination is this
// process's own rows (any buffer, not only a transport field): the rows of rank 0 go there, those
// of other ranks are skipped. One rank scatters its token rows into table order so (each token's
// row read once for its K routes, where a pull of the table reads it K times).
struct PushRows {
  const unsigned char* src;
  const std::int64_t* dst_ptrs;
  const std::int32_t* row_src_rank;
  const std::int32_t* row_route;
  std::int64_t capacity;
  std::int64_t row_bytes;
  std::int64_t src_stride;
  std::int64_t dst_stride;
  std::int64_t src_divisor = 1;
  unsigned char* dst_local = nullptr;

  MOK_HD const unsigned char* src_row(std::int64_t i) const {
    return src + i / src_divisor * src_stride;
  }
  // nullptr for a padding row or one without a destination row (a route no table lists: row -1),
  // and, with dst_local, for a row of another rank.
  MOK_HD unsigned char* dst_row(std::int64_t i) const {
    const std::int32_t s = row_src_rank[i];
    if (s < 0 || row_route[i] < 0 || (dst_local != nullptr && s != 0)) return nullptr;
    unsigned char* base = dst_local != nullptr ? dst_local : rank_base(dst_ptrs, s);
    return base + static_cast<std::int64_t>(row_route[i]) * dst_stride;
  }
};

// Zero-fill: table row i of dst, for every padding row (row_src_rank[i] < 0). Rows pushed into a
// table by their sources (the push dispatch) leave the padding rows untouched; the GEMMs read
// them (the weight gradients sum over every row of a segment), so they must be zero.
struct ZeroRows {
  unsigned char* dst;
  const std::int32_t* row_src_rank;
  std::int64_t capacity;
  std::int64_t row_bytes;
  std::int64_t dst_stride;

  MOK_HD unsigned char* dst_row(std::int64_t i) const { return dst + i * dst_stride; }
  MOK_HD bool padding(std::int64_t i) const { return row_src_rank[i] < 0; }
};

// Rows [*begin, *end) of worker w out of n: contiguous, sizes differing by at most one. The CPU
// backend's split (each thread streams through one range of the destination).
MOK_HD inline void worker_rows(std::int64_t capacity, std::int64_t n, std::int64_t w,
                               std::int64_t* begin, std::int64_t* end) {
  *begin = capacity / n * w + (w < capacity % n ? w : capacity % n);
  *end = *begin + capacity / n + (w < capacity % n ? 1 : 0);
}

// The widest access (16, 8, 4, 2 or 1 bytes) at which both addresses are aligned.
MOK_HD inline int common_alignment(const void* a, const void* b) {
  const std::uintptr_t bits =
      reinterpret_cast<std::uintptr_t>(a) | reinterpret_cast<std::uintptr_t>(b);
  return (bits & 15) == 0  ? 16
         : (bits & 7) == 0 ? 8
         : (bits & 3) == 0 ? 4
         : (bits & 1) == 0 ? 2
                           : 1;
}

// ---------------------------------------------------------------------------------------------
// Epoch barrier. Rank r's signal pad holds world_size uint64 slots; slot s is the last word rank
// s announced to r: its epoch e in the high bits and the barrier's tag (the caller's identity of
// this barrier: its stage and which call it is in, kTagBits bits) in the low ones. A barrier bumps
// the caller's local epoch to e, stores (e, tag) into its own slot of every pad (release, system
// scope), then waits until every slot of its own pad holds an epoch >= e (acquire). Epochs only
// grow, so a pad is never reset. A peer in step holds epoch e with the same tag, or e + 1 (it has
// passed this barrier: it saw this rank's word and checked the tag itself); any other word (the
// same epoch at another barrier, or an epoch further ahead: a call this rank did not make) is a
// rank out of step, reported as such instead of being passed.
inline constexpr int kTagBits = 24;
inline constexpr std::uint64_t kTagMask = (std::uint64_t{1} << kTagBits) - 1;

MOK_HD inline std::uint64_t barrier_word(std::uint64_t epoch, std::uint32_t tag) {
  return (epoch << kTagBits) | (tag & kTagMask);
}

// Slot `slot` of rank `pad_rank`'s pad.
MOK_HD inline std::uint64_t* signal_slot(const std::int64_t* pad_ptrs, std::int32_t pad_rank,
                                         std::int32_t slot) {
  return reinterpret_cast<std::uint64_t*>(rank_base(pad_ptrs, pad_rank)) + slot;
}

// `Sync` supplies the memory operations of one side: store_release / load_acquire on uint64 and
// int32, store_relaxed on int32, now_ns() and pause(spins). The loops below take (first, step)
// so that a CUDA block spreads the peers over its threads and a CPU thread walks all of them.

// Announces (epoch, tag) to the peers first, first + step, ...
template <class Sync>
MOK_HD void barrier_arrive(const std::int64_t* pad_ptrs, std::int32_t rank, std::int32_t world_size,
                           std::uint64_t epoch, std::uint32_t tag, std::int32_t first,
                           std::int32_t step) {
  for (std::int32_t p = first; p < world_size; p += step) {
    // Release: everything this rank wrote before the barrier -> the peer's acquire of this slot.
    Sync::store_release(signal_slot(pad_ptrs, p, rank), barrier_word(epoch, tag));
  }
}

// What barrier_wait found: every peer in step (peer = -1), or the first peer that was not.
struct BarrierMiss {
  std::int32_t peer;
  std::int32_t code;  // kErrorTimeout or kErrorOutOfStep
};

// Waits for the peers first, first + step, ... to announce `epoch` with `tag` (or to be one
// barrier ahead); the first peer still missing when timeout_ns had passed, or out of step.
template <class Sync>
MOK_HD BarrierMiss barrier_wait(const std::int64_t* pad_ptrs, std::int32_t rank,
                                std::int32_t world_size, std::uint64_t epoch, std::uint32_t tag,
                                std::int64_t timeout_ns, std::int32_t first, std::int32_t step) {
  const std::int64_t start = Sync::now_ns();
  for (std::int32_t p = first; p < world_size; p += step) {
    const std::uint64_t* slot = signal_slot(pad_ptrs, rank, p);
    // Acquire: peer p's release store of this slot -> this rank's reads of p's data afterwards.
    std::uint64_t word = Sync::load_acquire(slot);
    for (std::uint32_t spins = 0; (word >> kTagBits) < epoch; ++spins) {
      if (Sync::now_ns() - start > timeout_ns) return {p, kErrorTimeout};
      Sync::pause(spins);
      word = Sync::load_acquire(slot);
    }
    const std::uint64_t at = word >> kTagBits;
    const bool in_step = at == epoch ? (word & kTagMask) == (tag & kTagMask) : at == epoch + 1;
    if (!in_step) return {p, kErrorOutOfStep};
  }
  return {-1, 0};
}

// Fills the error words for a wait on `peer` that failed with `code` (call only while the code
// is 0).
template <class Sync>
MOK_HD void record_error(std::int32_t* error, std::int32_t code, std::int32_t peer,
                         std::int32_t stage, std::int32_t rank) {
  Sync::store_relaxed(error + kErrorPeer, peer);
  Sync::store_relaxed(error + kErrorStage, stage);
  Sync::store_relaxed(error + kErrorRank, rank);
  // Release: the peer/stage/rank words above -> whoever acquires the code (host or device).
  Sync::store_release(error + kErrorCode, code);
}

}  // namespace mok::core::transport

#if defined(__CUDACC__)
// ---------------------------------------------------------------------------------------------
// Device side: the primitives of the CUDA transport kernels, public so that the fused kernels of
// the precision packages move rows and meet at barriers exactly as mok-core's own kernels do.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "mok's transport needs sm_70 or newer (ld.acquire / st.release at system scope)"
#endif

namespace mok::core::transport {

// System-scope memory operations: peers read and write these words over NVLink (P2P), and the
// host may read the error words, so every one of them is .sys.
struct DeviceSync {
  static __device__ __forceinline__ void store_release(std::uint64_t* p, std::uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
  static __device__ __forceinline__ void store_release(std::int32_t* p, std::int32_t v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
  static __device__ __forceinline__ void store_relaxed(std::int32_t* p, std::int32_t v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
  static __device__ __forceinline__ std::uint64_t load_acquire(const std::uint64_t* p) {
    std::uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
  }
  static __device__ __forceinline__ std::int32_t load_acquire(const std::int32_t* p) {
    std::int32_t v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  // Nanoseconds of the GPU's global timer (the same clock on every SM of the device).
  static __device__ __forceinline__ std::int64_t now_ns() {
    std::uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return static_cast<std::int64_t>(t);
  }
  // Spinning on the local pad reads L2 only; a peer's store reaches it over NVLink in ~1 µs, so a
  // short sleep after the first spins costs nothing measurable and frees issue slots.
  static __device__ __forceinline__ void pause(std::uint32_t spins) {
    if (spins >= 64) __nanosleep(64);
  }
};

// Copies `n` vectors of type V with one warp. Each lane issues up to kUnroll independent loads
// (predicated at the row's end, so the last round is as deep as the others) before its stores:
// peer memory is ~2 µs away, and bytes in flight are what a copy over NVLink is made of.
template <typename V, int kUnroll = 4>
__device__ __forceinline__ void warp_copy_vectors(unsigned char* dst, const unsigned char* src,
                                                  std::int64_t n, int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  for (std::int64_t j = lane; j < n; j += kUnroll * 32) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * 32 < n) v[u] = s[j + u * 32];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j + u * 32 < n) d[j + u * 32] = v[u];
    }
  }
}

template <typename V>
__device__ __forceinline__ void warp_zero_vectors(unsigned char* dst, std::int64_t n, int lane) {
  V* d = reinterpret_cast<V*>(dst);
  const V zero{};
  for (std::int64_t j = lane; j < n; j += 32) d[j] = zero;
}

// One warp copies one row of `bytes`: at the widest width both addresses allow (16 bytes for rows
// of any 16-byte-aligned tensor), then the tail (< width bytes) byte by byte. Warp-uniform
// branches: every lane sees the same addresses. kUnroll deepens the 16-byte path only (activation
// rows); the narrower ones (router weights, odd offsets) keep 2, so their registers do not limit
// how many warps a CTA can hold.
template <int kUnroll = 4>
__device__ __forceinline__ void warp_copy_row(unsigned char* dst, const unsigned char* src,
                                              std::int64_t bytes, int lane) {
  // Rows live in global memory (local, a peer's over NVLink, or mapped host memory). Said so, the
  // compiler emits LDG/STG instead of generic LD/ST for addresses read from the pointer arrays.
  __builtin_assume(__isGlobal(dst));
  __builtin_assume(__isGlobal(src));
  const int width = common_alignment(dst, src);
  const std::int64_t body = bytes / width * width;
  switch (width) {
    case 16:
      warp_copy_vectors<uint4, kUnroll>(dst, src, body / 16, lane);
      break;
    case 8:
      warp_copy_vectors<uint2, 2>(dst, src, body / 8, lane);
      break;
    case 4:
      warp_copy_vectors<std::uint32_t, 2>(dst, src, body / 4, lane);
      break;
    case 2:
      warp_copy_vectors<std::uint16_t, 2>(dst, src, body / 2, lane);
      break;
    default:
      warp_copy_vectors<std::uint8_t, 2>(dst, src, body, lane);
      break;
  }
  for (std::int64_t j = body + lane; j < bytes; j += 32) dst[j] = src[j];
}

// One warp zero-fills one row of `bytes`.
__device__ __forceinline__ void warp_zero_row(unsigned char* dst, std::int64_t bytes, int lane) {
  __builtin_assume(__isGlobal(dst));
  const int width = common_alignment(dst, dst);
  const std::int64_t body = bytes / width * width;
  switch (width) {
    case 16:
      warp_zero_vectors<uint4>(dst, body / 16, lane);
      break;
    case 8:
      warp_zero_vectors<uint2>(dst, body / 8, lane);
      break;
    case 4:
      warp_zero_vectors<std::uint32_t>(dst, body / 4, lane);
      break;
    case 2:
      warp_zero_vectors<std::uint16_t>(dst, body / 2, lane);
      break;
    default:
      warp_zero_vectors<std::uint8_t>(dst, body, lane);
      break;
  }
  for (std::int64_t j = body + lane; j < bytes; j += 32) dst[j] = 0;
}

}  // namespace mok::core::transport
#endif  // __CUDACC__
