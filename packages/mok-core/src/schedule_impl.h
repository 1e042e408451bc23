// Host entry points of the schedule table and the send side (docs/core-runtime.md "Schedule"):
// argument checks and the CPU build in src/schedule.cpp, the CUDA launches in cuda/schedule.cu.
#pragma once

#include <cstdint>
#include <string_view>

#include "mok/core/schedule.h"

namespace mok::core {

// Pointers are addresses (Python ints); sizes arrive unchecked from Python.
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

// The RouteSource of checked TableArgs.
RouteSource route_source(const TableArgs& args);

struct SendSideArgs {
  std::uintptr_t top_experts = 0;  // int32 [T, K]
  std::int64_t num_tokens = 0;
  std::int64_t topk = 0;
  std::int64_t num_local_experts = 0;
  std::int64_t world_size = 0;
  std::uintptr_t send_order = 0;   // int64 [T*K]
  std::uintptr_t send_counts = 0;  // int64 [R]
  std::uintptr_t scratch = 0;      // optional (CUDA), as TableArgs::scratch
};

// schedule_capacity(...) after checking its arguments (std::invalid_argument naming the bad one,
// also when the table would not fit int32 rows).
std::int64_t checked_schedule_capacity(std::string_view function, std::int64_t world_size,
                                       std::int64_t max_tokens, std::int64_t topk,
                                       std::int64_t num_local_experts, std::int64_t alignment);

// Checked calls: std::invalid_argument for a bad argument, std::runtime_error for "cuda"
// without CUDA or a failed launch.
void build_table(std::string_view device, const TableArgs& args, std::uintptr_t stream);
void build_send_side(std::string_view device, const SendSideArgs& args, std::uintptr_t stream);

// The implementations, on arguments already checked.
void build_table_cpu(const TableArgs& args);
void build_send_side_cpu(const SendSideArgs& args);
#if MOK_WITH_CUDA
void build_table_cuda(const TableArgs& args, std::uintptr_t stream);
void build_send_side_cuda(const SendSideArgs& args, std::uintptr_t stream);
#endif

}  // namespace mok::core
