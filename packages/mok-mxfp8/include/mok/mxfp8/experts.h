// The MXFP8 expert entry points: the routed SwiGLU experts of DESIGN.md §1 on MXFP8 operands
// (DESIGN.md §8, docs/mxfp8.md "Where the layer quantizes" and "Arithmetic").
//
// Rows are table rows, each with its local expert (-1: a padding row). Activations x and dy
// come as MXFP8 rows (H E4M3 bytes, then H/32 E8M0 scales, row-major); weights as
// mok.mxfp8_quantize makes them (normal and transposed copies, block-major scales). Every
// reduction runs in blocks of 32: a block's partial is a sequential fp32 sum from +0, the
// partials are added in block order to an accumulator from +0. The weight gradients quantize
// their operands along rows in blocks of 32 rows counted from the call's first row, which must
// therefore be a table row at a multiple of 32 (segments start at multiples of the expert
// alignment, itself a multiple of 32): every 32-row block holds the rows of at most one expert.
// The CPU implementation gives the bits of mok-torch's reference backend in MXFP8.
#pragma once

#include <cstdint>
#include <string>

#include "mok/core/expert_math.h"
#include "mok/mxfp8/format.h"

namespace mok::mxfp8 {

using core::SwigluLimit;

// An expert-stacked weight [El, R, C] quantized both ways (mok.mxfp8_quantize).
struct MxWeight {
  std::uintptr_t data = 0;      // uint8 E4M3 [El, R, C], blocks along C
  std::uintptr_t scales = 0;    // uint8 E8M0 [El, C/32, R] (block-major)
  std::uintptr_t data_t = 0;    // uint8 E4M3 [El, C, R]: the transposed copy, blocks along R
  std::uintptr_t scales_t = 0;  // uint8 E8M0 [El, R/32, C]
};

struct MxExpertShape {
  std::int64_t num_rows = 0;     // M
  std::int64_t hidden = 0;       // H, a multiple of 32
  std::int64_t inner = 0;        // I, a multiple of 32
  std::int64_t num_experts = 0;  // El
};

struct MxForwardArgs {
  std::uintptr_t x = 0;        // uint8 MXFP8 rows [M, H + H/32]
  std::uintptr_t experts = 0;  // int64 [M], in [-1, El)
  MxWeight gate, up;           // [El, I, H]
  MxWeight down;               // [El, H, I] (its pointers may be 0 when out_y is 0)
  std::uintptr_t out_a = 0;    // bf16 [M, I]
  std::uintptr_t out_b = 0;    // bf16 [M, I]
  std::uintptr_t out_y = 0;    // bf16 [M, H] or 0
  MxExpertShape shape;
  SwigluLimit limit;
  std::int64_t num_threads = 1;
};

struct MxBackwardArgs {
  std::uintptr_t x = 0;               // uint8 MXFP8 rows [M, H + H/32]
  std::uintptr_t a = 0;               // bf16 [M, I], the forward's pre-activations
  std::uintptr_t b = 0;               // bf16 [M, I]
  std::uintptr_t dy = 0;              // uint8 MXFP8 rows [M, H + H/32]
  std::uintptr_t router_weights = 0;  // fp32 [M] or 0 (all ones)
  std::uintptr_t experts = 0;         // int64 [M]
  MxWeight gate, up, down;
  std::uintptr_t out_dx = 0;       // bf16 [M, H]
  std::uintptr_t out_d_w = 0;      // fp32 [M]
  std::uintptr_t acc_gate_up = 0;  // fp32 [El, 2I, H], added to (gate rows first)
  std::uintptr_t acc_down = 0;     // fp32 [El, H, I], added to
  MxExpertShape shape;
  SwigluLimit limit;
  std::int64_t num_threads = 1;
};

inline constexpr std::int64_t kMaxExpertThreads = 1024;

// device "cpu" (or "cuda": not implemented yet, raises std::runtime_error). Bad arguments raise
// std::invalid_argument naming them.
void swiglu_forward(const std::string& device, const MxForwardArgs& args, std::uintptr_t stream);
void swiglu_backward(const std::string& device, const MxBackwardArgs& args, std::uintptr_t stream);

void swiglu_forward_cpu(const MxForwardArgs& args);
void swiglu_backward_cpu(const MxBackwardArgs& args);

}  // namespace mok::mxfp8
