// The schedule table (docs/design.md §6, docs/core-runtime.md "Schedule"): the integer pieces that
// the CPU build (src/schedule.cpp), the CUDA kernels (cuda/schedule.cu) and the precision
// packages' fused kernels share.
//
// A route is one (token t, slot k) pair, with route index t*K + k inside its source rank. The
// table of rank `rank` lists, per local expert e (global id rank*El + e), every route to it in
// (source rank, t, k) order, starting at a multiple of the alignment; the rows between segments
// and past the last one are padding (-1). Only integer sums decide where a row goes, so any
// builder that keeps the (source rank, t, k) order within each expert gives the same bits.
#pragma once

#include <cstdint>

#include "mok/core/hd.h"

namespace mok::core {

// The table stores rows, offsets and route indices as int32.
inline constexpr std::int64_t kMaxTableRows = INT32_MAX;

MOK_HD inline bool is_power_of_two(std::int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// n rounded up to a multiple of a (a >= 1; a power of two in the table, but any a works).
MOK_HD inline std::int64_t align_up(std::int64_t n, std::int64_t a) { return (n + a - 1) / a * a; }

// Worst-case rows of the table: every route of every rank to this rank's experts, plus the
// padding of each expert's segment. Equals mok_torch's Workspace.capacity.
MOK_HD inline std::int64_t schedule_capacity(std::int64_t world_size, std::int64_t max_tokens,
                                             std::int64_t topk, std::int64_t num_local_experts,
                                             std::int64_t alignment) {
  return align_up(world_size * max_tokens * topk + num_local_experts * (alignment - 1), alignment);
}

// Token count of a source rank as the table reads it: rows t < tokens are routes; a count
// outside [0, max_tokens] is clamped (never read past a rank's routes).
MOK_HD inline std::int64_t clamp_tokens(std::int64_t tokens, std::int64_t max_tokens) {
  return tokens < 0 ? 0 : (tokens > max_tokens ? max_tokens : tokens);
}

// The local expert of a route in `rank`'s table, or El when the route goes to another rank
// (or names no expert at all).
MOK_HD inline int local_expert(std::int32_t global_expert, int rank, int num_local_experts) {
  const std::int64_t local = static_cast<std::int64_t>(global_expert) -
                             static_cast<std::int64_t>(rank) * num_local_experts;
  return (local >= 0 && local < num_local_experts) ? static_cast<int>(local) : num_local_experts;
}

// Where a table build reads each source rank's routes and token count, and writes each route's
// row: through per-rank pointer arrays (the transport's fields of every rank), or, at one rank,
// straight from this rank's own routes ([T, K], int32 or int64) and T, into its own route-row
// array (nothing copied into the transport first). An int64 id outside int32 reads as the nearest
// int32, which is outside [0, E) too: recorded as a bad id, never wrapped onto a valid one.
struct RouteSource {
  const std::int64_t* routes_ptrs = nullptr;     // int64 [R]: rank s's int32 routes (or null)
  const std::int64_t* tokens_ptrs = nullptr;     // int64 [R]: rank s's int64 count (or null)
  const std::int64_t* route_row_ptrs = nullptr;  // int64 [R]: rank s's int32 route rows, or null
  bool local = false;                            // one rank, its own arrays below:
  const void* local_routes = nullptr;            //   its routes [T, K]
  bool local_int64 = false;                      //   ... as int64 (else int32)
  std::int64_t local_tokens = 0;                 //   its token count T
  std::int32_t* local_route_row = nullptr;       //   its route rows [T * K] (or null)
  std::int32_t* local_routes_copy = nullptr;     //   its routes as read, int32 [T * K] (or null)

  MOK_HD std::int32_t id(int s, std::int64_t i) const {
    if (!local) return reinterpret_cast<const std::int32_t*>(routes_ptrs[s])[i];
    if (!local_int64) return static_cast<const std::int32_t*>(local_routes)[i];
    const std::int64_t v = static_cast<const std::int64_t*>(local_routes)[i];
    return v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : static_cast<std::int32_t>(v));
  }
  MOK_HD std::int64_t tokens(int s) const {
    return local ? local_tokens : *reinterpret_cast<const std::int64_t*>(tokens_ptrs[s]);
  }
  // At one rank a route no segment lists (its id is no expert's) gets row -1 in the route rows,
  // so that every route's row is defined (each route's row is written once: -1 here in the
  // counting pass, the others where they are placed). Across ranks such a route's row is left as
  // it was: no rank's table lists it.
  MOK_HD void no_row(std::int64_t i) const {
    if (local && local_route_row != nullptr) local_route_row[i] = -1;
  }
  // At one rank each route's id as the table reads it (int32; an int64 id outside int32 as the
  // nearest), into local_routes_copy when given: the schedule's own copy of the routes, written
  // in the counting pass, which reads every route once (no copy kernel).
  MOK_HD void copy_id(std::int64_t i, std::int32_t id) const {
    if (local && local_routes_copy != nullptr) local_routes_copy[i] = id;
  }
  // Rank s's array of route rows, or null (not written).
  MOK_HD std::int32_t* route_rows(int s) const {
    if (local) return local_route_row;
    return route_row_ptrs == nullptr ? nullptr : reinterpret_cast<std::int32_t*>(route_row_ptrs[s]);
  }
};

// A route whose expert id lies outside [0, E) routes nowhere. A table build given the error
// words (transport.h) also records the first such route, (source s, route index i) smallest, as
// code kErrorBadExpert and this word over error words 2-3 (the largest word is the first route):
// the high half INT32_MAX - (s * max_tokens * K + i), the low half the id. The table's rows
// (R * max_tokens * K < 2^31, schedule_capacity) keep the flat index in int32.
MOK_HD inline std::uint64_t bad_expert_word(std::int64_t flat_route, std::int32_t id) {
  return (static_cast<std::uint64_t>(INT32_MAX - flat_route) << 32) |
         static_cast<std::uint32_t>(id);
}

// The send side sorts a rank's routes stably by global expert id. The counting sort behind it
// has num_experts + 2 buckets: ids below 0 first (bucket 0), then experts 0..E-1 (buckets
// 1..E), then ids >= E (bucket E+1). Valid ids (what mok-torch passes) sort exactly like the
// reference's stable sort; invalid ones are never counted for any rank.
MOK_HD inline int send_bucket(std::int32_t global_expert, int num_experts) {
  if (global_expert < 0) return 0;
  return global_expert < num_experts ? global_expert + 1 : num_experts + 1;
}

// The multi-CTA build of the CUDA table and send side (cuda/schedule.cu) sorts each source's routes
// in chunks of this many (one CTA per chunk) and keeps one int32 count per (chunk, bucket) in a
// scratch buffer: sort_scratch_ints of them.
inline constexpr std::int64_t kSortChunkRoutes = 2048;

MOK_HD inline std::int64_t sort_scratch_ints(std::int64_t num_sources,
                                             std::int64_t routes_per_source,
                                             std::int64_t num_buckets) {
  return num_sources * ((routes_per_source + kSortChunkRoutes - 1) / kSortChunkRoutes) *
         num_buckets;
}

// Scratch bytes that serve both builds of one schedule (the table's El buckets over R sources of
// max_tokens * K routes, then the send side's E + 2 buckets over this rank's routes).
MOK_HD inline std::int64_t schedule_scratch_bytes(std::int64_t world_size, std::int64_t max_tokens,
                                                  std::int64_t topk,
                                                  std::int64_t num_local_experts) {
  const std::int64_t table = sort_scratch_ints(world_size, max_tokens * topk, num_local_experts);
  const std::int64_t send =
      sort_scratch_ints(1, max_tokens * topk, world_size * num_local_experts + 2);
  return 4 * (table > send ? table : send);
}

// Segment start of each local expert from its row count: offsets[e] = sum over e' < e of
// align_up(counts[e'], alignment); offsets[El] = rows in use. (The CUDA build computes the same
// integer prefix sums warp-parallel.)
template <class Count, class Offset>
MOK_HD inline void segment_offsets(const Count* counts, int num_local_experts,
                                   std::int64_t alignment, Offset* offsets) {
  std::int64_t row = 0;
  for (int e = 0; e < num_local_experts; ++e) {
    offsets[e] = static_cast<Offset>(row);
    row += align_up(static_cast<std::int64_t>(counts[e]), alignment);
  }
  offsets[num_local_experts] = static_cast<Offset>(row);
}

// The arguments of a table build (src/schedule_impl.h's build_table; mok_core.build_table in
// Python; mok-bf16's forward call through EntryPoints, entry_points.h). Pointers are addresses
// (Python ints); sizes arrive unchecked.
struct TableArgs {
  std::uintptr_t routes_ptrs = 0;  // int64 [R]: rank s's int32 routes [max_tokens, K]
  std::uintptr_t tokens_ptrs = 0;  // int64 [R]: address of rank s's int64 token count
  std::int64_t world_size = 0;
  std::int64_t max_tokens = 0;
  std::int64_t topk = 0;
  std::int64_t rank = 0;
  std::int64_t num_local_experts = 0;
  std::int64_t alignment = 0;
  std::int64_t capacity = 0;
  std::uintptr_t row_src_rank = 0;     // int32 [capacity]
  std::uintptr_t row_route = 0;        // int32 [capacity]
  std::uintptr_t expert_offsets = 0;   // int32 [El + 1]
  std::uintptr_t expert_counts = 0;    // int32 [El]
  std::uintptr_t recv_counts = 0;      // int64 [R]
  std::uintptr_t tokens_per_rank = 0;  // int64 [R]
  // Optional. int64 [R]: rank s's int32 [max_tokens * K] array that gets, for each of its routes
  // to this rank, the route's row in this table (a push dispatch's destination, a pull combine's
  // source); 0: not written.
  std::uintptr_t route_row_ptrs = 0;
  // Optional (CUDA): int32 scratch of schedule_scratch_bytes(...) bytes; given, the table is built
  // by many CTAs (two kernels), else by one.
  std::uintptr_t scratch = 0;
  // Optional: the transport's int32 [4] error words (8-byte aligned), which get the first route
  // with an expert id outside [0, R * El) (schedule.h, bad_expert_word); 0: not recorded.
  std::uintptr_t error = 0;
  // One rank only, with local_routes (schedule.h, RouteSource): this rank's routes [num_tokens, K]
  // read in place at `routes` (int32, or int64 with routes_int64) instead of through routes_ptrs /
  // tokens_ptrs (which may then be 0), and each route's row written to route_row (int32
  // [num_tokens * K], or 0: not written) instead of through route_row_ptrs (which must be 0);
  // routes_copy (int32 [num_tokens * K], or 0) gets each route's id as the table read it.
  bool local_routes = false;
  std::uintptr_t routes = 0;
  bool routes_int64 = false;
  std::int64_t num_tokens = 0;
  std::uintptr_t route_row = 0;
  std::uintptr_t routes_copy = 0;
};

}  // namespace mok::core
