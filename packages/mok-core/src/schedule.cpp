// The schedule table and the send side: argument checks, device dispatch and the CPU build.
//
// The CPU build is the plain statement of the table: count each local expert's routes, lay the
// segments out at aligned offsets, then place the routes in (source rank, t, k) order with a
// running position per expert. The CUDA build (cuda/schedule.cu) gives the same bits.
#include "mok/core/schedule.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "device_kind.h"
#include "mok/core/transport.h"
#include "schedule_impl.h"

namespace mok::core {
namespace {

constexpr std::int64_t kInt32Max = INT32_MAX;

std::string str(std::int64_t v) { return std::to_string(v); }

// The CPU build's record of its first bad expert id (schedule.h, bad_expert_word), on one thread;
// the CUDA build does the same with atomics. A code already set by another error stays.
void record_bad_expert(std::int32_t* error, std::uint64_t word) {
  using namespace transport;
  if (error[kErrorCode] != 0 && error[kErrorCode] != kErrorBadExpert) return;
  std::uint64_t held = 0;
  std::memcpy(&held, error + kErrorStage, sizeof(held));
  if (word > held) std::memcpy(error + kErrorStage, &word, sizeof(word));
  error[kErrorCode] = kErrorBadExpert;
}

void check_at_least(std::string_view fn, const char* name, std::int64_t value, std::int64_t min) {
  if (value < min)
    invalid_argument(fn, std::string(name) + " must be >= " + str(min) + ", got " + str(value));
}

void check_at_most(std::string_view fn, const char* name, std::int64_t value, std::int64_t max) {
  if (value > max)
    invalid_argument(fn, std::string(name) + " must be <= " + str(max) + ", got " + str(value));
}

// A pointer argument: non-null when `needed`, and aligned for its element type.
void check_pointer(std::string_view fn, const char* name, std::uintptr_t ptr, std::size_t align,
                   bool needed = true) {
  if (ptr == 0) {
    if (needed) invalid_argument(fn, std::string(name) + " must not be 0 (a null pointer)");
    return;
  }
  if (ptr % align != 0) {
    invalid_argument(fn, std::string(name) + " must be aligned to " +
                             str(static_cast<std::int64_t>(align)) + " bytes, got address " +
                             std::to_string(ptr));
  }
}

}  // namespace

// The capacity the table needs; checks the arguments it depends on.
std::int64_t checked_schedule_capacity(std::string_view fn, std::int64_t world_size,
                                       std::int64_t max_tokens, std::int64_t topk,
                                       std::int64_t num_local_experts, std::int64_t alignment) {
  check_at_least(fn, "world_size", world_size, 1);
  check_at_least(fn, "max_tokens", max_tokens, 0);
  check_at_least(fn, "topk", topk, 1);
  check_at_least(fn, "num_local_experts", num_local_experts, 1);
  if (!is_power_of_two(alignment)) {
    invalid_argument(fn, "alignment must be a power of two, got " + str(alignment));
  }
  // Bounded factors, so the products below cannot overflow int64.
  check_at_most(fn, "world_size", world_size, kInt32Max);
  check_at_most(fn, "max_tokens", max_tokens, kInt32Max);
  check_at_most(fn, "topk", topk, kInt32Max);
  check_at_most(fn, "num_local_experts", num_local_experts, kInt32Max);
  check_at_most(fn, "alignment", alignment, std::int64_t{1} << 30);
  if (world_size * num_local_experts > kInt32Max) {
    invalid_argument(
        fn, "world_size * num_local_experts (the global expert count) must fit int32, got " +
                str(world_size * num_local_experts));
  }
  const std::int64_t routes = world_size * max_tokens;
  const std::int64_t capacity =
      routes > kMaxTableRows
          ? kMaxTableRows + 1
          : schedule_capacity(world_size, max_tokens, topk, num_local_experts, alignment);
  if (capacity > kMaxTableRows) {
    invalid_argument(fn, "the table would need more than 2^31 - 1 rows (world_size " +
                             str(world_size) + ", max_tokens " + str(max_tokens) + ", topk " +
                             str(topk) + ", num_local_experts " + str(num_local_experts) +
                             ", alignment " + str(alignment) + "): its rows are int32");
  }
  return capacity;
}

void build_table(std::string_view device, const TableArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "build_table";
  const DeviceKind kind = parse_device(device, fn);
  const std::int64_t needed = checked_schedule_capacity(fn, a.world_size, a.max_tokens, a.topk,
                                                        a.num_local_experts, a.alignment);
  if (a.rank < 0 || a.rank >= a.world_size) {
    invalid_argument(
        fn, "rank must be in [0, world_size = " + str(a.world_size) + "), got " + str(a.rank));
  }
  if (a.capacity < needed) {
    invalid_argument(fn, "capacity must be >= schedule_capacity(...) = " + str(needed) + ", got " +
                             str(a.capacity));
  }
  check_at_most(fn, "capacity", a.capacity, kMaxTableRows);
  const bool local = a.local_routes;
  if (local) {
    if (a.world_size != 1) {
      invalid_argument(fn,
                       "local_routes (one rank's routes read in place) needs world_size 1, got " +
                           str(a.world_size) + " (pass routes_ptrs / tokens_ptrs)");
    }
    if (a.route_row_ptrs != 0) {
      invalid_argument(
          fn, "with local_routes the route rows go to route_row: route_row_ptrs must be 0");
    }
    check_at_least(fn, "num_tokens", a.num_tokens, 0);
    check_at_most(fn, "num_tokens", a.num_tokens, a.max_tokens);
    check_pointer(fn, "routes", a.routes, a.routes_int64 ? 8 : 4, a.num_tokens > 0);
    check_pointer(fn, "route_row", a.route_row, 4, false);
    check_pointer(fn, "routes_copy", a.routes_copy, 4, false);
  } else {
    if (a.routes_copy != 0) {
      invalid_argument(fn, "routes_copy (a copy of one rank's routes) needs local_routes");
    }
    check_pointer(fn, "routes_ptrs", a.routes_ptrs, 8);
    check_pointer(fn, "tokens_ptrs", a.tokens_ptrs, 8);
  }
  check_pointer(fn, "row_src_rank", a.row_src_rank, 4, a.capacity > 0);
  check_pointer(fn, "row_route", a.row_route, 4, a.capacity > 0);
  check_pointer(fn, "expert_offsets", a.expert_offsets, 4);
  check_pointer(fn, "expert_counts", a.expert_counts, 4);
  check_pointer(fn, "recv_counts", a.recv_counts, 8);
  check_pointer(fn, "tokens_per_rank", a.tokens_per_rank, 8);
  check_pointer(fn, "route_row_ptrs", a.route_row_ptrs, 8, false);
  check_pointer(fn, "scratch", a.scratch, 4, false);
  check_pointer(fn, "error", a.error, 8, false);
  if (kind == DeviceKind::kCpu && !local) {
    // Host memory: the per-rank pointers can be checked before anything is written.
    const auto* routes = reinterpret_cast<const std::int64_t*>(a.routes_ptrs);
    const auto* tokens = reinterpret_cast<const std::int64_t*>(a.tokens_ptrs);
    for (std::int64_t s = 0; s < a.world_size; ++s) {
      const std::string at = "[" + str(s) + "]";
      check_pointer(fn, ("tokens_ptrs" + at).c_str(), static_cast<std::uintptr_t>(tokens[s]), 8);
      const std::int64_t n =
          clamp_tokens(*reinterpret_cast<const std::int64_t*>(tokens[s]), a.max_tokens);
      check_pointer(fn, ("routes_ptrs" + at).c_str(), static_cast<std::uintptr_t>(routes[s]), 4,
                    n > 0);
    }
  }
  if (kind == DeviceKind::kCpu) {
    build_table_cpu(a);
    return;
  }
#if MOK_WITH_CUDA
  build_table_cuda(a, stream);
#else
  (void)stream;
#endif
}

RouteSource route_source(const TableArgs& a) {
  RouteSource src;
  if (a.local_routes) {
    src.local = true;
    src.local_routes = reinterpret_cast<const void*>(a.routes);
    src.local_int64 = a.routes_int64;
    src.local_tokens = a.num_tokens;
    src.local_route_row = reinterpret_cast<std::int32_t*>(a.route_row);
    src.local_routes_copy = reinterpret_cast<std::int32_t*>(a.routes_copy);
  } else {
    src.routes_ptrs = reinterpret_cast<const std::int64_t*>(a.routes_ptrs);
    src.tokens_ptrs = reinterpret_cast<const std::int64_t*>(a.tokens_ptrs);
    src.route_row_ptrs = reinterpret_cast<const std::int64_t*>(a.route_row_ptrs);
  }
  return src;
}

void build_table_cpu(const TableArgs& a) {
  const int R = static_cast<int>(a.world_size);
  const int K = static_cast<int>(a.topk);
  const int El = static_cast<int>(a.num_local_experts);
  const int rank = static_cast<int>(a.rank);
  const RouteSource src = route_source(a);
  auto* row_src = reinterpret_cast<std::int32_t*>(a.row_src_rank);
  auto* row_route = reinterpret_cast<std::int32_t*>(a.row_route);
  auto* offsets = reinterpret_cast<std::int32_t*>(a.expert_offsets);
  auto* counts = reinterpret_cast<std::int32_t*>(a.expert_counts);
  auto* recv = reinterpret_cast<std::int64_t*>(a.recv_counts);
  auto* tokens_out = reinterpret_cast<std::int64_t*>(a.tokens_per_rank);

  std::vector<std::int64_t> num_routes(R);
  for (int s = 0; s < R; ++s) {
    const std::int64_t tokens = src.tokens(s);
    tokens_out[s] = tokens;
    num_routes[s] = clamp_tokens(tokens, a.max_tokens) * K;
  }

  // Pass 1: routes per local expert and per source (and the first id outside [0, E)).
  std::vector<std::int64_t> next(El, 0);
  std::uint64_t bad = 0;
  const std::int64_t E = static_cast<std::int64_t>(R) * El;
  for (int s = 0; s < R; ++s) {
    std::int64_t mine = 0;
    for (std::int64_t i = 0; i < num_routes[s]; ++i) {
      const std::int32_t id = src.id(s, i);
      src.copy_id(i, id);
      if (bad == 0 && (id < 0 || id >= E)) bad = bad_expert_word(s * a.max_tokens * K + i, id);
      const int e = local_expert(id, rank, El);
      if (e < El) {
        ++next[e];
        ++mine;
      } else {
        src.no_row(i);
      }
    }
    recv[s] = mine;
  }
  for (int e = 0; e < El; ++e) counts[e] = static_cast<std::int32_t>(next[e]);
  segment_offsets(counts, El, a.alignment, offsets);
  if (bad != 0 && a.error != 0) record_bad_expert(reinterpret_cast<std::int32_t*>(a.error), bad);

  // Pass 2: every row padding first, then each route at its expert's running position.
  std::fill(row_src, row_src + a.capacity, -1);
  std::fill(row_route, row_route + a.capacity, -1);
  for (int e = 0; e < El; ++e) next[e] = offsets[e];
  for (int s = 0; s < R; ++s) {
    std::int32_t* route_row = src.route_rows(s);
    for (std::int64_t i = 0; i < num_routes[s]; ++i) {
      const int e = local_expert(src.id(s, i), rank, El);
      if (e < El) {
        const std::int64_t row = next[e]++;
        row_src[row] = s;
        row_route[row] = static_cast<std::int32_t>(i);
        if (route_row != nullptr) route_row[i] = static_cast<std::int32_t>(row);
      }
    }
  }
}

void build_send_side(std::string_view device, const SendSideArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "build_send_side";
  const DeviceKind kind = parse_device(device, fn);
  check_at_least(fn, "num_tokens", a.num_tokens, 0);
  check_at_least(fn, "topk", a.topk, 1);
  check_at_least(fn, "num_local_experts", a.num_local_experts, 1);
  check_at_least(fn, "world_size", a.world_size, 1);
  check_at_most(fn, "topk", a.topk, kInt32Max);
  check_at_most(fn, "world_size", a.world_size, kInt32Max);
  check_at_most(fn, "num_local_experts", a.num_local_experts, kInt32Max);
  // Room for the two buckets of invalid ids next to the experts (schedule.h: send_bucket).
  if (a.world_size * a.num_local_experts > kInt32Max - 2) {
    invalid_argument(
        fn, "world_size * num_local_experts (the global expert count) must be < 2^31 - 2, got " +
                str(a.world_size * a.num_local_experts));
  }
  if (a.num_tokens > kInt32Max / a.topk) {
    invalid_argument(
        fn, "num_tokens * topk must fit int32, got " + str(a.num_tokens) + " * " + str(a.topk));
  }
  const bool any = a.num_tokens > 0;
  check_pointer(fn, "top_experts", a.top_experts, 4, any);
  check_pointer(fn, "send_order", a.send_order, 8, any);
  check_pointer(fn, "send_counts", a.send_counts, 8);
  check_pointer(fn, "scratch", a.scratch, 4, false);
  if (kind == DeviceKind::kCpu) {
    build_send_side_cpu(a);
    return;
  }
#if MOK_WITH_CUDA
  build_send_side_cuda(a, stream);
#else
  (void)stream;
#endif
}

void build_send_side_cpu(const SendSideArgs& a) {
  const std::int64_t n = a.num_tokens * a.topk;
  const int E = static_cast<int>(a.world_size * a.num_local_experts);
  const auto* keys = reinterpret_cast<const std::int32_t*>(a.top_experts);
  auto* order = reinterpret_cast<std::int64_t*>(a.send_order);
  auto* send_counts = reinterpret_cast<std::int64_t*>(a.send_counts);

  // A stable counting sort over the send buckets.
  std::vector<std::int64_t> next(static_cast<std::size_t>(E) + 2, 0);
  for (std::int64_t i = 0; i < n; ++i) ++next[send_bucket(keys[i], E)];
  std::int64_t start = 0;
  for (std::int64_t& b : next) {
    const std::int64_t count = b;
    b = start;
    start += count;
  }
  // Bucket 1 + e starts expert e, so rank r's routes are [start(1 + r*El), start(1 + (r+1)*El)).
  for (std::int64_t r = 0; r < a.world_size; ++r) {
    send_counts[r] = next[1 + (r + 1) * a.num_local_experts] - next[1 + r * a.num_local_experts];
  }
  for (std::int64_t i = 0; i < n; ++i) order[next[send_bucket(keys[i], E)]++] = i;
}

}  // namespace mok::core
