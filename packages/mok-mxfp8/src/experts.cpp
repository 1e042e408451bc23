// The MXFP8 expert entry points' host side: argument checks and the device dispatch.
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "mok/mxfp8/experts.h"

namespace mok::mxfp8 {
namespace {

[[noreturn]] void invalid(const std::string& fn, const std::string& what) {
  throw std::invalid_argument(fn + ": " + what);
}

std::string got(std::int64_t v) { return ", got " + std::to_string(v); }

void check_pointer(const std::string& fn, const std::string& name, std::uintptr_t p,
                   std::uintptr_t align) {
  if (p == 0) invalid(fn, name + " must not be 0 (a null pointer)");
  if (p % align != 0) invalid(fn, name + " must be aligned to " + std::to_string(align) + " bytes");
}

void check_weight(const std::string& fn, const std::string& name, const MxWeight& w) {
  check_pointer(fn, name + ".data", w.data, 1);
  check_pointer(fn, name + ".scales", w.scales, 1);
  check_pointer(fn, name + ".data_t", w.data_t, 1);
  check_pointer(fn, name + ".scales_t", w.scales_t, 1);
}

// The host reads the offsets (CPU calls): non-decreasing, within [0, num_rows].
void check_offsets_on_host(const std::string& fn, std::uintptr_t offsets, std::int64_t num_experts,
                           std::int64_t num_rows) {
  const auto* off = reinterpret_cast<const std::int64_t*>(offsets);
  for (std::int64_t e = 0; e <= num_experts; ++e) {
    if (off[e] < 0 || off[e] > num_rows || (e > 0 && off[e] < off[e - 1])) {
      invalid(fn,
              "offsets must be non-decreasing within [0, num_rows = " + std::to_string(num_rows) +
                  "]: offsets[" + std::to_string(e) + "]" + got(off[e]));
    }
  }
}

void check_common(const std::string& fn, const MxExpertShape& s, SwigluLimit limit,
                  std::int64_t num_threads, std::uintptr_t experts, bool per_row = true) {
  if (s.num_rows < 0) invalid(fn, "num_rows must be >= 0" + got(s.num_rows));
  if (s.hidden <= 0 || s.hidden % kBlock)
    invalid(fn, "hidden must be a positive multiple of 32" + got(s.hidden));
  if (s.inner <= 0 || s.inner % kBlock)
    invalid(fn, "inner must be a positive multiple of 32" + got(s.inner));
  if (s.num_experts < 1) invalid(fn, "num_experts must be >= 1" + got(s.num_experts));
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 16;
  const std::int64_t wide = s.hidden > 2 * s.inner ? s.hidden : 2 * s.inner;
  if ((s.num_rows > 0 && wide > kMax / s.num_rows) || s.inner > kMax / s.hidden ||
      s.num_experts > kMax / (2 * s.inner * s.hidden)) {
    invalid(fn, "the arrays are too large");
  }
  if (limit.on && !(limit.limit >= 0.0f)) invalid(fn, "limit must be None or a number >= 0");
  if (num_threads < 1 || num_threads > kMaxExpertThreads) {
    invalid(fn, "num_threads must be in [1, " + std::to_string(kMaxExpertThreads) + "]" +
                    got(num_threads));
  }
  if (s.num_rows == 0 || !per_row) return;
  check_pointer(fn, "experts", experts, 8);
  // Every expert id in [-1, El), and every 32-row block holding at most one expert.
  const auto* e = reinterpret_cast<const std::int64_t*>(experts);
  std::int64_t block_expert = -1;
  for (std::int64_t m = 0; m < s.num_rows; ++m) {
    if (m % kBlock == 0) block_expert = -1;
    if (e[m] < -1 || e[m] >= s.num_experts) {
      invalid(fn, "experts[" + std::to_string(m) + "] must be in [-1, num_experts = " +
                      std::to_string(s.num_experts) + ")" + got(e[m]));
    }
    if (e[m] >= 0) {
      if (block_expert >= 0 && e[m] != block_expert) {
        invalid(fn,
                "rows " + std::to_string(m / kBlock * kBlock) + ".." +
                    std::to_string(m / kBlock * kBlock + kBlock - 1) +
                    " hold two experts: the call must start at a table row that is a multiple of "
                    "32, with segments aligned to multiples of 32");
      }
      block_expert = e[m];
    }
  }
}

[[noreturn]] void no_cuda(const std::string& fn) {
  throw std::runtime_error(fn +
                           ": device=\"cuda\": the MXFP8 expert kernels for the GPU are not "
                           "written yet (the CPU implementation runs with device=\"cpu\")");
}

void check_device(const std::string& fn, const std::string& device) {
  if (device != "cpu" && device != "cuda") {
    invalid(fn, "device must be \"cpu\" or \"cuda\", got \"" + device + "\"");
  }
}

}  // namespace

#if !MOK_WITH_CUDA
// Built without CUDA: the GPU entry points say so by name.
namespace {
[[noreturn]] void built_without_cuda(const std::string& fn) {
  throw std::runtime_error(fn +
                           ": device=\"cuda\" but mok-mxfp8 was built without CUDA "
                           "(MOK_CUDA=OFF, or no nvcc at build time)");
}
}  // namespace
void grouped_forward_cuda(const MxGroupedForwardArgs&, std::uintptr_t) {
  built_without_cuda("grouped_forward");
}
void grouped_gemm_cuda(const MxGroupedGemmArgs&, std::uintptr_t) {
  built_without_cuda("grouped_gemm");
}
void grouped_wgrad_cuda(const MxGroupedWgradArgs&, std::uintptr_t) {
  built_without_cuda("grouped_wgrad");
}
void grouped_swiglu_backward_cuda(const MxSwigluBackwardArgs&, std::uintptr_t) {
  built_without_cuda("grouped_swiglu_backward");
}
#endif

void swiglu_forward(const std::string& device, const MxForwardArgs& args,
                    std::uintptr_t /*stream*/) {
  const std::string fn = "swiglu_forward";
  check_device(fn, device);
  check_common(fn, args.shape, args.limit, args.num_threads, args.experts);
  if (args.shape.num_rows == 0) return;
  check_pointer(fn, "x", args.x, 1);
  check_weight(fn, "gate", args.gate);
  check_weight(fn, "up", args.up);
  if (args.out_y != 0) check_weight(fn, "down", args.down);
  check_pointer(fn, "out_a", args.out_a, 2);
  check_pointer(fn, "out_b", args.out_b, 2);
  if (args.out_y % 2 != 0) invalid(fn, "out_y must be aligned to 2 bytes");
  if (device == "cuda") no_cuda(fn);
  swiglu_forward_cpu(args);
}

void swiglu_backward(const std::string& device, const MxBackwardArgs& args,
                     std::uintptr_t /*stream*/) {
  const std::string fn = "swiglu_backward";
  check_device(fn, device);
  check_common(fn, args.shape, args.limit, args.num_threads, args.experts);
  if (args.shape.num_rows == 0) return;
  check_pointer(fn, "x", args.x, 1);
  check_pointer(fn, "a", args.a, 2);
  check_pointer(fn, "b", args.b, 2);
  check_pointer(fn, "dy", args.dy, 1);
  if (args.router_weights % 4 != 0) invalid(fn, "router_weights must be aligned to 4 bytes");
  check_weight(fn, "gate", args.gate);
  check_weight(fn, "up", args.up);
  check_weight(fn, "down", args.down);
  check_pointer(fn, "out_dx", args.out_dx, 2);
  check_pointer(fn, "out_d_w", args.out_d_w, 4);
  check_pointer(fn, "acc_gate_up", args.acc_gate_up, 4);
  check_pointer(fn, "acc_down", args.acc_down, 4);
  if (device == "cuda") no_cuda(fn);
  swiglu_backward_cpu(args);
}

void grouped_forward(const std::string& device, const MxGroupedForwardArgs& a,
                     std::uintptr_t stream) {
  const std::string fn = "grouped_forward";
  check_device(fn, device);
  const MxExpertShape& s = a.shape;
  check_common(fn, s, a.limit, a.num_threads, 0, /*per_row=*/false);
  const bool cuda = device == "cuda";
  if (cuda && (s.hidden % 64 != 0 || s.inner % 64 != 0)) {
    invalid(fn, "on \"cuda\", hidden and inner must be multiples of 64, got hidden " +
                    std::to_string(s.hidden) + ", inner " + std::to_string(s.inner));
  }
  if (cuda && s.num_experts > 1024) {
    invalid(fn, "on \"cuda\", num_experts must be <= 1024" + got(s.num_experts));
  }
  if (a.num_sms < 0) invalid(fn, "num_sms must be >= 0 (0: every SM)" + got(a.num_sms));
  const std::int64_t packed = s.hidden + s.hidden / kBlock;
  if (a.x_row_bytes != 0 && a.x_row_bytes < packed) {
    invalid(fn, "x_row_bytes must be 0 or >= hidden + hidden/32 = " + std::to_string(packed) +
                    got(a.x_row_bytes));
  }
  // The copy engine reads 16-byte aligned rows; the CPU loops any layout.
  const std::uintptr_t al = cuda ? 16 : 1;
  const std::int64_t row_bytes = a.x_row_bytes != 0 ? a.x_row_bytes : packed;
  if (cuda && row_bytes % 16 != 0) {
    invalid(fn,
            "on \"cuda\", x's rows must be 16-byte aligned: x_row_bytes must be a multiple of "
            "16" +
                got(row_bytes));
  }
  check_pointer(fn, "offsets", a.offsets, 8);
  if (s.num_rows == 0) return;
  check_pointer(fn, "x", a.x, al);
  check_pointer(fn, "gate.data", a.gate.data, al);
  check_pointer(fn, "gate.scales", a.gate.scales, al);
  check_pointer(fn, "up.data", a.up.data, al);
  check_pointer(fn, "up.scales", a.up.scales, al);
  check_pointer(fn, "out_a", a.out_a, cuda ? 4 : 2);
  check_pointer(fn, "out_b", a.out_b, cuda ? 4 : 2);
  if (a.out_y != 0) {
    check_pointer(fn, "out_y", a.out_y, cuda ? 4 : 2);
    check_pointer(fn, "out_h", a.out_h, cuda ? 16 : 2);
    check_pointer(fn, "out_hq", a.out_hq, al);
    check_pointer(fn, "down.data", a.down.data, al);
    check_pointer(fn, "down.scales", a.down.scales, al);
  }
  if (cuda) return grouped_forward_cuda(a, stream);
  check_offsets_on_host(fn, a.offsets, s.num_experts, s.num_rows);
  grouped_forward_cpu(a);
}

void grouped_gemm(const std::string& device, const MxGroupedGemmArgs& a, std::uintptr_t stream) {
  const std::string fn = "grouped_gemm";
  check_device(fn, device);
  const bool cuda = device == "cuda";
  if (a.num_rows < 0) invalid(fn, "num_rows must be >= 0" + got(a.num_rows));
  if (a.n <= 0) invalid(fn, "n must be >= 1" + got(a.n));
  if (a.k <= 0 || a.k % kBlock) invalid(fn, "k must be a positive multiple of 32" + got(a.k));
  if (a.num_experts < 1) invalid(fn, "num_experts must be >= 1" + got(a.num_experts));
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 16;
  if ((a.num_rows > 0 && (a.n > kMax / a.num_rows || a.k > kMax / a.num_rows)) ||
      a.num_experts > kMax / (a.n * a.k)) {
    invalid(fn, "the arrays are too large");
  }
  const bool split = a.k_split != 0;
  if (split && (a.k_split < 0 || a.k_split >= a.k || a.k_split % kBlock)) {
    invalid(fn, "k_split must be 0 or a multiple of 32 in (0, k = " + std::to_string(a.k) + ")" +
                    got(a.k_split));
  }
  if (cuda && (a.n % 64 != 0 || a.k % 64 != 0)) {
    invalid(fn, "on \"cuda\", n and k must be multiples of 64, got n " + std::to_string(a.n) +
                    ", k " + std::to_string(a.k));
  }
  if (cuda && split && a.k_split % 64 != 0) {
    invalid(fn, "on \"cuda\", k_split must be a multiple of 64" + got(a.k_split));
  }
  if (cuda && a.num_experts > 1024) {
    invalid(fn, "on \"cuda\", num_experts must be <= 1024" + got(a.num_experts));
  }
  if (a.num_sms < 0) invalid(fn, "num_sms must be >= 0 (0: every SM)" + got(a.num_sms));
  if (a.num_threads < 1 || a.num_threads > kMaxExpertThreads) {
    invalid(fn, "num_threads must be in [1, " + std::to_string(kMaxExpertThreads) + "]" +
                    got(a.num_threads));
  }
  const std::int64_t a_cols = split_a_cols(a.k, a.k_split);
  const std::int64_t packed = a_cols + a_cols / kBlock;
  if (a.a_row_bytes != 0 && a.a_row_bytes < packed) {
    invalid(fn, "a_row_bytes must be 0 or >= K_A + K_A/32 = " + std::to_string(packed) +
                    " (K_A = split_a_cols(k, k_split))" + got(a.a_row_bytes));
  }
  const std::int64_t row_bytes = a.a_row_bytes != 0 ? a.a_row_bytes : packed;
  if (cuda && row_bytes % 16 != 0) {
    invalid(fn,
            "on \"cuda\", A's rows must be 16-byte aligned: a_row_bytes must be a multiple of 16" +
                got(row_bytes));
  }
  check_pointer(fn, "offsets", a.offsets, 8);
  if (a.num_rows == 0) return;
  const std::uintptr_t al = cuda ? 16 : 1;
  check_pointer(fn, "a", a.a, al);
  check_pointer(fn, "b0_data", a.b0_data, al);
  check_pointer(fn, "b0_scales", a.b0_scales, al);
  if (split) {
    check_pointer(fn, "b1_data", a.b1_data, al);
    check_pointer(fn, "b1_scales", a.b1_scales, al);
  }
  check_pointer(fn, "out", a.out, a.out_fp32 ? (cuda ? 8 : 4) : (cuda ? 4 : 2));
  if (cuda) return grouped_gemm_cuda(a, stream);
  check_offsets_on_host(fn, a.offsets, a.num_experts, a.num_rows);
  grouped_gemm_cpu(a);
}

void grouped_wgrad(const std::string& device, const MxGroupedWgradArgs& a, std::uintptr_t stream) {
  const std::string fn = "grouped_wgrad";
  check_device(fn, device);
  const bool cuda = device == "cuda";
  if (a.num_rows < 0 || a.num_rows % kBlock) {
    invalid(fn, "num_rows must be a multiple of 32 (>= 0)" + got(a.num_rows));
  }
  if (a.r <= 0 || a.r % 64) invalid(fn, "r must be a positive multiple of 64" + got(a.r));
  if (a.c <= 0 || a.c % 64) invalid(fn, "c must be a positive multiple of 64" + got(a.c));
  if (a.num_experts < 1 || a.num_experts > 1024) {
    invalid(fn, "num_experts must be in [1, 1024]" + got(a.num_experts));
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 16;
  if (a.r > kMax / a.c || a.num_experts > kMax / (a.r * a.c) ||
      (a.num_rows > 0 && (a.r > kMax / a.num_rows || a.c > kMax / a.num_rows))) {
    invalid(fn, "the arrays are too large");
  }
  if (a.num_sms < 0) invalid(fn, "num_sms must be >= 0 (0: every SM)" + got(a.num_sms));
  if (a.num_threads < 1 || a.num_threads > kMaxExpertThreads) {
    invalid(fn, "num_threads must be in [1, " + std::to_string(kMaxExpertThreads) + "]" +
                    got(a.num_threads));
  }
  const std::int64_t a_row = a.a_row_bytes != 0 ? a.a_row_bytes : a.num_rows;
  const std::int64_t b_row = a.b_row_bytes != 0 ? a.b_row_bytes : a.num_rows;
  if (a_row < a.num_rows) invalid(fn, "a_row_bytes must be 0 or >= num_rows" + got(a_row));
  if (b_row < a.num_rows) invalid(fn, "b_row_bytes must be 0 or >= num_rows" + got(b_row));
  if (cuda && (a_row % 16 != 0 || b_row % 16 != 0)) {
    invalid(fn, "on \"cuda\", a_row_bytes and b_row_bytes must be multiples of 16, got " +
                    std::to_string(a_row) + " and " + std::to_string(b_row));
  }
  if (a.out_f32 == 0 && a.out_bf16 == 0) invalid(fn, "out_f32 and out_bf16 must not both be 0");
  check_pointer(fn, "offsets", a.offsets, 8);
  if (a.out_f32 != 0) check_pointer(fn, "out_f32", a.out_f32, cuda ? 8 : 4);
  if (a.out_bf16 != 0) check_pointer(fn, "out_bf16", a.out_bf16, cuda ? 4 : 2);
  if (a.carry != 0) check_pointer(fn, "carry", a.carry, cuda ? 8 : 4);
  if (a.num_rows > 0) {
    const std::uintptr_t al = cuda ? 16 : 1;
    check_pointer(fn, "a_data", a.a_data, al);
    check_pointer(fn, "a_scales", a.a_scales, al);
    check_pointer(fn, "b_data", a.b_data, al);
    check_pointer(fn, "b_scales", a.b_scales, al);
  }
  if (cuda) return grouped_wgrad_cuda(a, stream);
  check_offsets_on_host(fn, a.offsets, a.num_experts, a.num_rows);
  const auto* off = reinterpret_cast<const std::int64_t*>(a.offsets);
  for (std::int64_t e = 0; e <= a.num_experts; ++e) {
    if (off[e] % kBlock) {
      invalid(fn,
              "offsets must be multiples of 32: offsets[" + std::to_string(e) + "]" + got(off[e]));
    }
  }
  grouped_wgrad_cpu(a);
}

void grouped_swiglu_backward(const std::string& device, const MxSwigluBackwardArgs& a,
                             std::uintptr_t stream) {
  const std::string fn = "grouped_swiglu_backward";
  check_device(fn, device);
  const bool cuda = device == "cuda";
  if (a.num_rows < 0 || a.num_rows % kBlock) {
    invalid(fn, "num_rows must be a multiple of 32 (>= 0)" + got(a.num_rows));
  }
  if (a.hidden <= 0 || a.hidden % 64) {
    invalid(fn, "hidden must be a positive multiple of 64" + got(a.hidden));
  }
  if (a.inner <= 0 || a.inner % 64)
    invalid(fn, "inner must be a positive multiple of 64" + got(a.inner));
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 16;
  const std::int64_t wide = a.hidden > 2 * a.inner ? a.hidden : 2 * a.inner;
  if (a.num_rows > 0 && wide > kMax / a.num_rows) invalid(fn, "the arrays are too large");
  if (a.limit.on && !(a.limit.limit >= 0.0f)) invalid(fn, "limit must be None or a number >= 0");
  if (a.num_threads < 1 || a.num_threads > kMaxExpertThreads) {
    invalid(fn, "num_threads must be in [1, " + std::to_string(kMaxExpertThreads) + "]" +
                    got(a.num_threads));
  }
  const std::int64_t x_packed = a.hidden + a.hidden / kBlock;
  const std::int64_t dab_cols = split_a_cols(2 * a.inner, a.inner);
  const std::int64_t dab_packed = dab_cols + dab_cols / kBlock;
  const std::pair<const char*, std::int64_t> rows[] = {{"x_row_bytes", a.x_row_bytes},
                                                       {"dy_row_bytes", a.dy_row_bytes}};
  for (const auto& [name, bytes] : rows) {
    if (bytes != 0 && bytes < x_packed) {
      invalid(fn, std::string(name) + " must be 0 or >= hidden + hidden/32 = " +
                      std::to_string(x_packed) + got(bytes));
    }
    if (cuda && (bytes != 0 ? bytes : x_packed) % 16 != 0) {
      invalid(fn, std::string("on \"cuda\", ") + name + " must be a multiple of 16" +
                      got(bytes != 0 ? bytes : x_packed));
    }
  }
  if (a.dab_row_bytes != 0 && a.dab_row_bytes < dab_packed) {
    invalid(fn, "dab_row_bytes must be 0 or >= K_A + K_A/32 = " + std::to_string(dab_packed) +
                    " (K_A = split_a_cols(2 inner, inner))" + got(a.dab_row_bytes));
  }
  if (cuda && (a.dab_row_bytes != 0 ? a.dab_row_bytes : dab_packed) % 16 != 0) {
    invalid(fn, "on \"cuda\", dab_row_bytes must be a multiple of 16" +
                    got(a.dab_row_bytes != 0 ? a.dab_row_bytes : dab_packed));
  }
  if (a.router_weights % 4 != 0) invalid(fn, "router_weights must be aligned to 4 bytes");
  if (a.num_rows == 0) return;
  // The GPU reads and writes 16-byte vectors (the transposed copies' rows are M bytes apart).
  const std::uintptr_t al = cuda ? 16 : 1;
  check_pointer(fn, "g", a.g, cuda ? 16 : 4);
  check_pointer(fn, "a", a.a, cuda ? 16 : 2);
  check_pointer(fn, "b", a.b, cuda ? 16 : 2);
  check_pointer(fn, "x", a.x, al);
  check_pointer(fn, "dy", a.dy, al);
  check_pointer(fn, "out_d_w", a.out_d_w, 4);
  check_pointer(fn, "out_dab", a.out_dab, al);
  check_pointer(fn, "dab_t_data", a.dab_t_data, al);
  check_pointer(fn, "dab_t_scales", a.dab_t_scales, 1);
  check_pointer(fn, "h_t_data", a.h_t_data, al);
  check_pointer(fn, "h_t_scales", a.h_t_scales, 1);
  check_pointer(fn, "x_t_data", a.x_t_data, al);
  check_pointer(fn, "x_t_scales", a.x_t_scales, 1);
  check_pointer(fn, "wdy_t_data", a.wdy_t_data, al);
  check_pointer(fn, "wdy_t_scales", a.wdy_t_scales, 1);
  if (cuda) return grouped_swiglu_backward_cuda(a, stream);
  grouped_swiglu_backward_cpu(a);
}

}  // namespace mok::mxfp8
