// Host entry points of the schedule table and the send side (docs/core-runtime.md "Schedule"):
// argument checks and the CPU build in src/schedule.cpp, the CUDA launches in cuda/schedule.cu.
#pragma once

#include <cstdint>
#include <string_view>

#include "mok/core/schedule.h"  // TableArgs

namespace mok::core {

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
