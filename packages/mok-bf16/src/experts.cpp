// The expert entry points' host side: argument checks and the device dispatch.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

#include "mok/bf16/experts.h"

namespace mok::bf16 {
namespace {

enum class Device { kCpu, kCuda };

// "<function>: <what>" as std::invalid_argument, which pybind11 raises as ValueError.
[[noreturn]] void invalid(std::string_view fn, const std::string& what) {
  throw std::invalid_argument(std::string(fn) + ": " + what);
}

std::string got(std::int64_t v) { return ", got " + std::to_string(v); }

Device parse_device(std::string_view device, std::string_view fn) {
  if (device == "cpu") return Device::kCpu;
  if (device == "cuda") return Device::kCuda;
  invalid(fn, "device must be \"cpu\" or \"cuda\", got \"" + std::string(device) + "\"");
}

// A pointer the call reads or writes when `needed`; else it may be 0.
void check_pointer(std::string_view fn, const char* name, std::uintptr_t ptr, std::uintptr_t align,
                   bool needed) {
  if (ptr == 0) {
    if (needed) invalid(fn, std::string(name) + " must not be 0 (a null pointer)");
    return;
  }
  if (ptr % align != 0) {
    invalid(fn, std::string(name) + " must be aligned to " + std::to_string(align) +
                    " bytes, got address " + std::to_string(ptr));
  }
}

// Sizes, and the largest array's byte count fitting int64 (so no index computation overflows).
void check_shape(std::string_view fn, const ExpertShape& s) {
  if (s.num_rows < 0) invalid(fn, "num_rows must be >= 0" + got(s.num_rows));
  if (s.hidden < 0) invalid(fn, "hidden must be >= 0" + got(s.hidden));
  if (s.inner < 0) invalid(fn, "inner must be >= 0" + got(s.inner));
  if (s.num_experts < 1) invalid(fn, "num_experts must be >= 1" + got(s.num_experts));
  constexpr std::int64_t kMaxElements = std::numeric_limits<std::int64_t>::max() / 8;
  const auto fits = [&](std::int64_t a, std::int64_t b, std::int64_t c) {
    return a == 0 || b == 0 || c == 0 || (b <= kMaxElements / a && c <= kMaxElements / (a * b));
  };
  const bool small_inner = s.inner <= kMaxElements / 2;
  const std::int64_t wide = !small_inner || s.hidden > 2 * s.inner ? s.hidden : 2 * s.inner;
  if (!small_inner || !fits(s.num_rows, wide, 1) || !fits(s.num_experts, 2 * s.inner, s.hidden)) {
    invalid(fn, "the arrays are too large (num_rows " + std::to_string(s.num_rows) + ", hidden " +
                    std::to_string(s.hidden) + ", inner " + std::to_string(s.inner) +
                    ", num_experts " + std::to_string(s.num_experts) + ")");
  }
}

void check_limit(std::string_view fn, SwigluLimit limit) {
  if (limit.on && !(limit.limit >= 0.0f)) {
    invalid(fn, "limit must be None or a number >= 0, got " + std::to_string(limit.limit));
  }
}

void check_threads(std::string_view fn, std::int64_t num_threads) {
  if (num_threads < 1 || num_threads > kMaxThreads) {
    invalid(fn,
            "num_threads must be in [1, " + std::to_string(kMaxThreads) + "]" + got(num_threads));
  }
}

// Every row's expert in [-1, El): read on the host, so on the CPU path only.
void check_experts(std::string_view fn, std::uintptr_t experts, const ExpertShape& s) {
  const auto* e = reinterpret_cast<const std::int64_t*>(experts);
  for (std::int64_t m = 0; m < s.num_rows; ++m) {
    if (e[m] < -1 || e[m] >= s.num_experts) {
      invalid(fn, "experts[" + std::to_string(m) + "] must be in [-1, num_experts = " +
                      std::to_string(s.num_experts) + ")" + got(e[m]));
    }
  }
}

// The tensor-core tiles: 64 columns of bf16 per copy, every dimension a multiple of it; the tile
// list in shared memory; int32 coordinates of the copy engine.
void check_grouped_cuda_shape(std::string_view fn, const ExpertShape& s) {
  if (s.hidden % 64 != 0 || s.hidden == 0) {
    invalid(fn, "hidden must be a positive multiple of 64 on cuda" + got(s.hidden));
  }
  if (s.inner % 64 != 0 || s.inner == 0) {
    invalid(fn, "inner must be a positive multiple of 64 on cuda" + got(s.inner));
  }
  if (s.num_experts > kMaxGroupedExperts) {
    invalid(fn, "num_experts must be <= " + std::to_string(kMaxGroupedExperts) + " on cuda" +
                    got(s.num_experts));
  }
  constexpr std::int64_t kMaxInt = std::numeric_limits<std::int32_t>::max();
  if (s.num_rows > kMaxInt || s.num_experts * std::max(2 * s.inner, s.hidden) > kMaxInt) {
    invalid(fn, "num_rows and num_experts * max(hidden, 2 * inner) must fit int32 on cuda");
  }
}

// The CUDA side of a grouped entry point: the tile constraints, then `run` (the kernels) when
// there are rows. Returns false on the CPU. `run` is a generic lambda, instantiated only in a
// CUDA build (where the *_cuda functions exist).
template <class Args, class Run>
bool run_on_cuda(std::string_view fn, Device kind, const Args& a, std::uintptr_t stream,
                 const Run& run) {
  if (kind != Device::kCuda) return false;
  check_grouped_cuda_shape(fn, a.shape);
#if MOK_WITH_CUDA
  if (a.shape.num_rows > 0) run(a, stream);
#else
  (void)stream;
  (void)run;
  throw std::runtime_error(std::string(fn) +
                           ": device=\"cuda\" but mok-bf16 was built without CUDA (MOK_CUDA=OFF, "
                           "or no nvcc when it was built)");
#endif
  return true;
}

// Segment offsets read on the host (the CPU path): checked before anything is written.
void check_offsets(std::string_view fn, std::uintptr_t offsets, const ExpertShape& s) {
  const auto* off = reinterpret_cast<const std::int64_t*>(offsets);
  for (std::int64_t e = 0; e <= s.num_experts; ++e) {
    const std::int64_t lo = e == 0 ? 0 : off[e - 1];
    if (off[e] < lo || off[e] > s.num_rows) {
      invalid(fn,
              "offsets must be non-decreasing within [0, num_rows = " + std::to_string(s.num_rows) +
                  "]: offsets[" + std::to_string(e) + "]" + got(off[e]));
    }
  }
}

// Zeroes rows [0, offsets[0]) and [offsets[El], M) of a row-major array of `row_bytes` per row
// (checked offsets: those are the rows outside every segment); a null array is skipped.
void zero_outside_cpu(std::uintptr_t out, std::int64_t row_bytes, std::uintptr_t offsets,
                      const ExpertShape& s) {
  if (out == 0 || row_bytes == 0) return;
  const auto* off = reinterpret_cast<const std::int64_t*>(offsets);
  auto* p = reinterpret_cast<unsigned char*>(out);
  std::memset(p, 0, static_cast<std::size_t>(off[0] * row_bytes));
  const std::int64_t hi = off[s.num_experts];
  std::memset(p + hi * row_bytes, 0, static_cast<std::size_t>((s.num_rows - hi) * row_bytes));
}

[[noreturn]] void no_cuda_kernels(std::string_view fn) {
  throw std::runtime_error(std::string(fn) +
                           ": no CUDA implementation: these entry points compute the reference "
                           "arithmetic on the CPU (device=\"cpu\"); on the GPU the forward is "
                           "grouped_forward and grouped_backward");
}

}  // namespace

void swiglu_forward(std::string_view device, const SwigluForwardArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "swiglu_forward";
  const Device kind = parse_device(device, fn);
  const ExpertShape& s = a.shape;
  check_shape(fn, s);
  check_limit(fn, a.limit);
  check_threads(fn, a.num_threads);
  const bool rows = s.num_rows > 0;
  const bool gemm = rows && s.hidden > 0 && s.inner > 0;
  check_pointer(fn, "x", a.x, 2, rows && s.hidden > 0);
  check_pointer(fn, "experts", a.experts, 8, rows);
  check_pointer(fn, "w_gate", a.w_gate, 2, gemm);
  check_pointer(fn, "w_up", a.w_up, 2, gemm);
  check_pointer(fn, "out_a", a.out_a, 2, rows && s.inner > 0);
  check_pointer(fn, "out_b", a.out_b, 2, rows && s.inner > 0);
  check_pointer(fn, "out_y", a.out_y, 2, false);
  check_pointer(fn, "w_down", a.w_down, 2, gemm && a.out_y != 0);
  (void)stream;
  if (kind == Device::kCuda) no_cuda_kernels(fn);
  if (!rows) return;
  check_experts(fn, a.experts, s);
  swiglu_forward_cpu(a);
}

void swiglu_backward(std::string_view device, const SwigluBackwardArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "swiglu_backward";
  const Device kind = parse_device(device, fn);
  const ExpertShape& s = a.shape;
  check_shape(fn, s);
  check_limit(fn, a.limit);
  check_threads(fn, a.num_threads);
  const bool rows = s.num_rows > 0;
  const bool gemm = rows && s.hidden > 0 && s.inner > 0;
  check_pointer(fn, "x", a.x, 2, rows && s.hidden > 0);
  check_pointer(fn, "a", a.a, 2, rows && s.inner > 0);
  check_pointer(fn, "b", a.b, 2, rows && s.inner > 0);
  check_pointer(fn, "dy", a.dy, 2, rows && s.hidden > 0);
  check_pointer(fn, "router_weights", a.router_weights, 4, false);
  check_pointer(fn, "experts", a.experts, 8, rows);
  check_pointer(fn, "w_gate", a.w_gate, 2, gemm);
  check_pointer(fn, "w_up", a.w_up, 2, gemm);
  check_pointer(fn, "w_down", a.w_down, 2, gemm);
  check_pointer(fn, "out_dx", a.out_dx, 2, rows && s.hidden > 0);
  check_pointer(fn, "out_d_w", a.out_d_w, 4, rows);
  check_pointer(fn, "acc_gate_up", a.acc_gate_up, 4, gemm);
  check_pointer(fn, "acc_down", a.acc_down, 4, gemm);
  (void)stream;
  if (kind == Device::kCuda) no_cuda_kernels(fn);
  if (!rows) return;
  check_experts(fn, a.experts, s);
  swiglu_backward_cpu(a);
}

void grouped_forward(std::string_view device, const GroupedForwardArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "grouped_forward";
  const Device kind = parse_device(device, fn);
  const ExpertShape& s = a.shape;
  check_shape(fn, s);
  check_limit(fn, a.limit);
  check_threads(fn, a.num_threads);
  if (a.num_sms < 0) invalid(fn, "num_sms must be >= 0 (0: every SM)" + got(a.num_sms));
  const bool rows = s.num_rows > 0;
  const bool gemm = rows && s.hidden > 0 && s.inner > 0;
  // The copy engine reads 16-byte aligned arrays; the CPU loops any bf16 array.
  const std::uintptr_t al = kind == Device::kCuda ? 16 : 2;
  check_pointer(fn, "x", a.x, al, rows && s.hidden > 0);
  check_pointer(fn, "offsets", a.offsets, 8, true);
  check_pointer(fn, "w_gate", a.w_gate, al, gemm);
  check_pointer(fn, "w_up", a.w_up, al, gemm);
  check_pointer(fn, "out_a", a.out_a, al, rows && s.inner > 0);
  check_pointer(fn, "out_b", a.out_b, al, rows && s.inner > 0);
  check_pointer(fn, "out_y", a.out_y, al, false);
  check_pointer(fn, "out_h", a.out_h, al, gemm && a.out_y != 0);
  check_pointer(fn, "w_down", a.w_down, al, gemm && a.out_y != 0);
  if (run_on_cuda(fn, kind, a, stream,
                  [](const auto& args, std::uintptr_t st) { grouped_forward_cuda(args, st); })) {
    return;
  }
  check_offsets(fn, a.offsets, s);
  if (a.zero_outside) {
    for (const std::uintptr_t out : {a.out_a, a.out_b, a.out_h})
      zero_outside_cpu(out, 2 * s.inner, a.offsets, s);
    zero_outside_cpu(a.out_y, 2 * s.hidden, a.offsets, s);
  }
  if (gemm || rows) grouped_forward_cpu(a);
}

namespace {

// The weight gradients' targets (gate, up, down): each goes to its fp32 accumulator, its bf16
// output, or both; the accumulator is needed to carry C in, or where no output is given (when
// `weights`: the gradients exist, C or +0, even without rows).
void check_wgrad_targets(std::string_view fn, const std::array<std::uintptr_t, 3>& acc,
                         const std::array<std::uintptr_t, 3>& out, bool weights, bool carry_in,
                         std::uintptr_t acc_align, std::uintptr_t out_align) {
  static constexpr const char* kAcc[3] = {"acc_gate", "acc_up", "acc_down"};
  static constexpr const char* kOut[3] = {"out_gate", "out_up", "out_down"};
  for (int i = 0; i < 3; ++i) {
    check_pointer(fn, kAcc[i], acc[i], acc_align, weights && (carry_in || out[i] == 0));
    check_pointer(fn, kOut[i], out[i], out_align, false);
  }
}

// grouped_backward's checks of its arguments on the host (before anything is launched), the
// messages naming `fn`.
void check_grouped_backward(std::string_view fn, Device kind, const GroupedBackwardArgs& a) {
  const ExpertShape& s = a.shape;
  check_shape(fn, s);
  check_limit(fn, a.limit);
  check_threads(fn, a.num_threads);
  if (a.num_sms < 0) invalid(fn, "num_sms must be >= 0 (0: every SM)" + got(a.num_sms));
  const bool rows = s.num_rows > 0;
  const bool gemm = rows && s.hidden > 0 && s.inner > 0;
  const bool cuda = kind == Device::kCuda;
  const std::uintptr_t al = cuda ? 16 : 2;
  // (x is not read where dW1 gathers its rows from x_tokens)
  check_pointer(fn, "x", a.x, al, rows && s.hidden > 0 && !(cuda && a.dw1_mode == 2));
  check_pointer(fn, "offsets", a.offsets, 8, true);
  check_pointer(fn, "a", a.a, al, rows && s.inner > 0);
  check_pointer(fn, "b", a.b, al, rows && s.inner > 0);
  check_pointer(fn, "dy", a.dy, al, rows && s.hidden > 0);
  check_pointer(fn, "router_weights", a.router_weights, 4, false);
  check_pointer(fn, "w_gate", a.w_gate, al, gemm);
  check_pointer(fn, "w_up", a.w_up, al, gemm);
  check_pointer(fn, "w_down", a.w_down, al, gemm);
  check_pointer(fn, "out_dx", a.out_dx, al, rows && s.hidden > 0);
  check_pointer(fn, "out_d_w", a.out_d_w, 4, rows && (a.out_d_w_routes == 0 || a.zero_outside));
  check_pointer(fn, "out_d_w_routes", a.out_d_w_routes, 4, false);
  // The weight gradients exist (C, or +0) even without rows.
  const bool weights = s.hidden > 0 && s.inner > 0 && s.num_experts > 0;
  check_wgrad_targets(fn, {a.acc_gate, a.acc_up, a.acc_down}, {a.out_gate, a.out_up, a.out_down},
                      weights, a.carry_in, cuda ? 16 : 4, cuda ? 16 : 2);
  if (cuda && !rows && weights) {
    // No kernel runs without rows, so nothing would write C (or +0) to the outputs.
    invalid(fn,
            "num_rows = 0 on cuda: the weight gradients would not be written (mok_torch's "
            "grouped_backward writes them itself for zero rows)");
  }
  // g: stored only where given at I <= kGSwigluMaxInner (the fused g kernel needs no array).
  check_pointer(fn, "scratch_g", a.scratch_g, 16, cuda && gemm && s.inner > kGSwigluMaxInner);
  check_pointer(fn, "scratch_hw", a.scratch_hw, 16, cuda && gemm);
  check_pointer(fn, "scratch_d_ab", a.scratch_d_ab, 16, cuda && gemm);
  check_pointer(fn, "weight_route", a.weight_route, 4, false);
  if (a.weight_route != 0 && !cuda) {
    invalid(
        fn,
        "weight_route (weights read by route) is for 'cuda'; on 'cpu' pass them in table order");
  }
  if (a.weight_route != 0 && a.router_weights == 0) {
    invalid(fn, "weight_route needs router_weights (the routes' weights)");
  }
  if (a.weight_route != 0 &&
      (a.num_routes < 0 || a.num_routes > std::numeric_limits<std::int32_t>::max())) {
    invalid(fn, "num_routes must be in [0, 2^31) with weight_route" + got(a.num_routes));
  }
  if (a.out_d_w_routes != 0 && a.weight_route == 0) {
    invalid(fn, "out_d_w_routes needs weight_route (each row's route)");
  }
  check_pointer(fn, "dy_tokens", a.dy_tokens, 16, false);
  if (a.dy_tokens != 0) {
    if (!cuda) {
      invalid(fn, "dy_tokens (dy read by route) is for 'cuda'; on 'cpu' pass dy in table order");
    }
    if (a.weight_route == 0) invalid(fn, "dy_tokens needs weight_route (each row's route)");
    if (a.topk < 1 || a.num_routes % a.topk != 0) {
      invalid(fn, "topk must be >= 1 and divide num_routes with dy_tokens" + got(a.topk));
    }
    check_pointer(fn, "dy", a.dy, 16, true);  // scratch: maybe the gathered rows in table order
  }
  if (a.dwd_gather < -1 || a.dwd_gather > 1) {
    invalid(fn, "dwd_gather must be -1 (by the device), 0 or 1" + got(a.dwd_gather));
  }
  if (a.dw1_mode < 0 || a.dw1_mode > 2) {
    invalid(fn, "dw1_mode must be 0, 1 (x^T [d_a, d_b]) or 2 (x gathered from x_tokens)" +
                    got(a.dw1_mode));
  }
  check_pointer(fn, "x_tokens", a.x_tokens, 16, false);
  if (a.dw1_mode == 2) {
    if (!cuda) invalid(fn, "dw1_mode 2 (x gathered by route) is for 'cuda'");
    if (a.x_tokens == 0 || a.weight_route == 0) {
      invalid(fn, "dw1_mode 2 needs x_tokens and weight_route (each row's route)");
    }
    if (a.topk < 1 || a.num_routes % a.topk != 0) {
      invalid(fn, "topk must be >= 1 and divide num_routes with x_tokens" + got(a.topk));
    }
  } else if (a.x_tokens != 0) {
    invalid(fn, "x_tokens is read only with dw1_mode 2");
  }
}

// A schedule table's int32 offsets, read on the host: non-decreasing within [0, capacity].
void check_table_offsets(std::string_view fn, std::uintptr_t offsets, const ExpertShape& s) {
  const auto* off = reinterpret_cast<const std::int32_t*>(offsets);
  for (std::int64_t e = 0; e <= s.num_experts; ++e) {
    const std::int64_t lo = e == 0 ? 0 : off[e - 1];
    if (off[e] < lo || off[e] > s.num_rows) {
      invalid(fn,
              "offsets must be non-decreasing within [0, capacity = " + std::to_string(s.num_rows) +
                  "]: offsets[" + std::to_string(e) + "]" + got(off[e]));
    }
  }
}

}  // namespace

void grouped_backward(std::string_view device, const GroupedBackwardArgs& a,
                      std::uintptr_t stream) {
  constexpr std::string_view fn = "grouped_backward";
  const Device kind = parse_device(device, fn);
  const ExpertShape& s = a.shape;
  check_grouped_backward(fn, kind, a);
  if (run_on_cuda(fn, kind, a, stream,
                  [](const auto& args, std::uintptr_t st) { grouped_backward_cuda(args, st); })) {
    return;
  }
  check_offsets(fn, a.offsets, s);
  if (a.zero_outside) {
    zero_outside_cpu(a.out_dx, 2 * s.hidden, a.offsets, s);
    zero_outside_cpu(a.out_d_w, 4, a.offsets, s);
  }
  const bool weights = s.hidden > 0 && s.inner > 0 && s.num_experts > 0;
  if (weights || s.num_rows > 0) grouped_backward_cpu(a);
}

void moe_forward_call(const core::EntryPoints& core, std::string_view device, MoeForwardCallArgs a,
                      std::uintptr_t stream) {
  constexpr std::string_view fn = "moe_forward_call";
  const Device kind = parse_device(device, fn);
  if (!a.table.local_routes || a.table.world_size != 1) {
    invalid(fn,
            "the table must be one rank's, from its routes in place (local_routes, world_size 1)");
  }
  if (a.experts.world_size != 1) invalid(fn, "world_size must be 1" + got(a.experts.world_size));
  if (a.experts.row_route != a.table.row_route || a.experts.offsets != a.table.expert_offsets ||
      a.combine.rows != a.experts.out_rows || a.combine.row_index != 0) {
    invalid(fn,
            "the experts must read the table's row_route and offsets, and the combine their rows");
  }
  const bool cpu = kind != Device::kCuda;
  if (cpu && (a.experts.out_a != 0 || a.experts.out_b != 0 || a.experts.out_x != 0)) {
    invalid(fn,
            "out_a, out_b and out_x must be 0 on \"cpu\" (the context's rows are the table's, "
            "read on the host)");
  }
  const std::string dev(device);
  char message[512] = {};
  core::raise_entry_status(core.build_table(dev.c_str(), &a.table, stream, message, sizeof message),
                           message);
  if (cpu) {  // the rows in use: the table's end, which the CPU build has written
    const auto* offsets = reinterpret_cast<const std::int32_t*>(a.table.expert_offsets);
    const std::int64_t end = offsets[a.table.num_local_experts];
    a.experts.shape.num_rows = std::clamp<std::int64_t>(end, 0, a.experts.shape.num_rows);
  }
  moe_forward(device, a.experts, stream);
  core::raise_entry_status(core.combine(dev.c_str(), &a.combine, stream, message, sizeof message),
                           message);
}

void moe_backward_call(const core::EntryPoints& core, std::string_view device,
                       const MoeBackwardCallArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "moe_backward_call";
  if (parse_device(device, fn) != Device::kCuda) {
    invalid(fn, "device must be \"cuda\" (the kernels read dy and the weights by route), got \"" +
                    std::string(device) + "\"");
  }
  const GroupedBackwardArgs& e = a.experts;
  if (e.weight_route == 0 || e.dy_tokens == 0 || e.out_d_w_routes == 0 || e.out_dx != e.dy ||
      e.zero_outside) {
    invalid(fn,
            "the experts must read dy and the weights by route (weight_route, dy_tokens), store "
            "d_w by route (out_d_w_routes) and dx into dy's rows (out_dx = dy), with nothing "
            "zeroed outside the segments");
  }
  if (a.combine.rows != e.out_dx || a.combine.row_index == 0 ||
      a.combine.num_rows != e.shape.num_rows || a.combine.weights != 0 ||
      a.combine.num_tokens * a.combine.topk != e.num_routes || a.combine.topk != e.topk) {
    invalid(fn,
            "the combine must sum the experts' dx rows through the routes' rows (rows = out_dx, "
            "row_index, num_rows = the experts' rows), unweighted, over their routes");
  }
  if ((a.combine.error == 0) != (a.combine.error_mirror == 0)) {
    invalid(fn, "error and error_mirror must both be given or both be 0");
  }
  check_pointer(fn, "offsets32", a.offsets32, 4, true);
  check_pointer(fn, "offsets", e.offsets, 8, true);
  if (e.shape.num_rows < 1 || a.combine.num_tokens < 1) {
    invalid(fn,
            "num_rows and num_tokens must be >= 1 (with no rows or tokens the kernels would "
            "not write the weight gradients)");
  }
  if (e.shape.num_experts < 1 || e.shape.num_experts > kMaxGroupedExperts) {
    invalid(fn, "num_experts must be in [1, " + std::to_string(kMaxGroupedExperts) + "]" +
                    got(e.shape.num_experts));
  }
  check_pointer(fn, "out_d_w_routes", e.out_d_w_routes, 4, true);
  if (e.num_routes < 1 || e.num_routes > std::numeric_limits<std::int32_t>::max()) {
    invalid(fn, "num_routes must be in [1, 2^31)" + got(e.num_routes));
  }
  check_grouped_backward(fn, Device::kCuda, e);  // all of them before the first launch
#if MOK_WITH_CUDA
  moe_backward_prepare_cuda(a.offsets32, e.offsets, e.shape.num_experts, e.out_d_w_routes,
                            e.num_routes, stream);
#else
  throw std::runtime_error(std::string(fn) +
                           ": device=\"cuda\" but mok-bf16 was built without CUDA (MOK_CUDA=OFF, "
                           "or no nvcc when it was built)");
#endif
  grouped_backward(device, e, stream);
  const std::string dev(device);
  char message[512] = {};
  core::raise_entry_status(core.combine(dev.c_str(), &a.combine, stream, message, sizeof message),
                           message);
}

void moe_forward(std::string_view device, const MoeForwardArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "moe_forward";
  const Device kind = parse_device(device, fn);
  const ExpertShape& s = a.shape;
  check_shape(fn, s);
  check_limit(fn, a.limit);
  if (a.num_sms < 0) invalid(fn, "num_sms must be >= 0 (0: every SM)" + got(a.num_sms));
  if (a.num_tokens < 0) invalid(fn, "num_tokens must be >= 0" + got(a.num_tokens));
  if (a.topk < 1) invalid(fn, "topk must be >= 1" + got(a.topk));
  if (a.timeout_ns < 1) invalid(fn, "timeout_ns must be >= 1" + got(a.timeout_ns));
  if (a.num_tokens > std::numeric_limits<std::int32_t>::max() / a.topk) {
    invalid(fn, "num_tokens * topk must fit int32 (the table's routes)");
  }
  if ((a.out_a == 0) != (a.out_b == 0)) {
    invalid(fn,
            "out_a and out_b must both be given or both be 0 (no context: a forward that no "
            "backward follows)");
  }
  if (a.world_size < 1) invalid(fn, "world_size must be >= 1" + got(a.world_size));
  const bool ranks = a.world_size > 1;
  if (ranks && (a.row_src == 0 || a.x_ranks == 0 || a.out_rows_ranks == 0)) {
    invalid(fn, "row_src, x_ranks and out_rows_ranks are required when world_size > 1");
  }
  if (kind != Device::kCuda) {
    if (a.num_threads < 1) invalid(fn, "num_threads must be >= 1" + got(a.num_threads));
    const bool any = s.num_rows > 0;
    const bool tokens = a.num_tokens > 0;
    const auto need = [&](const char* name, std::uintptr_t p, bool required) {
      if (required && p == 0) invalid(fn, std::string(name) + " must be given (got 0)");
    };
    need("x", a.x, tokens && !ranks);
    need("out_rows", a.out_rows, tokens && !ranks);
    need("row_route", a.row_route, any);
    need("offsets", a.offsets, true);
    need("w_gate", a.w_gate, true);
    need("w_up", a.w_up, true);
    need("w_down", a.w_down, true);
    need("scratch_h", a.scratch_h, any);
    check_table_offsets(fn, a.offsets, s);
    moe_forward_cpu(a);
    return;
  }
  if (ranks && a.timers != 0) {
    invalid(fn, "timers must be 0 when world_size > 1 (a timed launch is one rank's)");
  }
  if (a.world_size > 65536) {  // the down tiles hold a row's source rank in 16 bits
    invalid(fn, "world_size must be <= 65536 on cuda" + got(a.world_size));
  }
  check_grouped_cuda_shape(fn, s);
  const bool rows = s.num_rows > 0;
  // Across ranks x and out_rows are not read: every rank's rows are x_ranks' and out_rows_ranks'.
  check_pointer(fn, "x", a.x, 16, a.num_tokens > 0 && !ranks);
  check_pointer(fn, "row_route", a.row_route, 4, rows);
  check_pointer(fn, "offsets", a.offsets, 4, true);
  check_pointer(fn, "w_gate", a.w_gate, 16, true);
  check_pointer(fn, "w_up", a.w_up, 16, true);
  check_pointer(fn, "w_down", a.w_down, 16, true);
  check_pointer(fn, "out_a", a.out_a, 16, false);
  check_pointer(fn, "out_b", a.out_b, 16, false);
  check_pointer(fn, "scratch_h", a.scratch_h, 16, rows);
  check_pointer(fn, "out_rows", a.out_rows, 16, a.num_tokens > 0 && !ranks);
  check_pointer(fn, "out_x", a.out_x, 16, false);
  check_pointer(fn, "task_state", a.task_state, 8, true);
  check_pointer(fn, "error", a.error, 4, true);
  check_pointer(fn, "row_src", a.row_src, 4, ranks && rows);
  check_pointer(fn, "x_ranks", a.x_ranks, 8, ranks);
  check_pointer(fn, "out_rows_ranks", a.out_rows_ranks, 8, ranks);
#if MOK_WITH_CUDA
  sm90::moe_forward_cuda(a, stream);
#else
  (void)stream;
  throw std::runtime_error(
      "moe_forward: mok-bf16 was built without CUDA (MOK_CUDA=OFF, or no nvcc when it was "
      "built)");
#endif
}

void moe_backward(std::string_view device, const MoeBackwardArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "moe_backward";
  (void)stream;  // "cpu" only
  if (parse_device(device, fn) != Device::kCpu) {
    invalid(fn,
            "device must be \"cpu\" (on \"cuda\" one rank's backward is moe_backward_call; the "
            "kernels do not take per-rank arguments yet), got \"" +
                std::string(device) + "\"");
  }
  const ExpertShape& s = a.shape;
  check_shape(fn, s);
  check_limit(fn, a.limit);
  check_threads(fn, a.num_threads);
  if (a.num_tokens < 0) invalid(fn, "num_tokens must be >= 0" + got(a.num_tokens));
  if (a.topk < 1) invalid(fn, "topk must be >= 1" + got(a.topk));
  if (a.num_tokens > std::numeric_limits<std::int32_t>::max() / a.topk) {
    invalid(fn, "num_tokens * topk must fit int32 (the table's routes)");
  }
  if (a.world_size < 1) invalid(fn, "world_size must be >= 1" + got(a.world_size));
  const bool ranks = a.world_size > 1;
  const bool rows = s.num_rows > 0;
  const bool tokens = a.num_tokens > 0;
  const bool weights = s.hidden > 0 && s.inner > 0 && s.num_experts > 0;
  check_pointer(fn, "x", a.x, 2, rows && s.hidden > 0);
  check_pointer(fn, "a", a.a, 2, rows && s.inner > 0);
  check_pointer(fn, "b", a.b, 2, rows && s.inner > 0);
  check_pointer(fn, "row_route", a.row_route, 4, rows);
  check_pointer(fn, "offsets", a.offsets, 4, true);
  check_pointer(fn, "w_gate", a.w_gate, 2, weights);
  check_pointer(fn, "w_up", a.w_up, 2, weights);
  check_pointer(fn, "w_down", a.w_down, 2, weights);
  // At one rank the arrays themselves; across ranks their addresses (the one-rank ones unread).
  check_pointer(fn, "dy", a.dy, 2, tokens && !ranks);
  check_pointer(fn, "router_weights", a.router_weights, 4, false);
  check_pointer(fn, "out_dx_rows", a.out_dx_rows, 2, tokens && !ranks);
  check_pointer(fn, "out_d_router", a.out_d_router, 4, false);
  check_pointer(fn, "row_src", a.row_src, 4, ranks && rows);
  check_pointer(fn, "dy_ranks", a.dy_ranks, 8, ranks);
  check_pointer(fn, "weights_ranks", a.weights_ranks, 8, ranks);
  check_pointer(fn, "out_dx_rows_ranks", a.out_dx_rows_ranks, 8, ranks);
  check_pointer(fn, "out_d_router_ranks", a.out_d_router_ranks, 8, false);
  check_wgrad_targets(fn, {a.acc_gate, a.acc_up, a.acc_down}, {a.out_gate, a.out_up, a.out_down},
                      weights, a.carry_in, 4, 2);
  check_table_offsets(fn, a.offsets, s);
  if (weights || rows) moe_backward_cpu(a);
}

}  // namespace mok::bf16
