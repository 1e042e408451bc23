// The MXFP8 expert entry points: the routed SwiGLU experts of docs/design.md §2 on MXFP8
// operands (docs/mxfp8.md "Where the layer quantizes" and "Arithmetic").
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

// grouped_forward: the forward over experts' segments of consecutive rows (rows [offsets[e],
// offsets[e+1]) are expert e's), the arithmetic of swiglu_forward:
//
//   [a, b] = x_q @ [Wg_e; Wu_e]^T,  h = bf16(silu(a) * b),  h_q = Q_I(h),  y = h_q @ Wd_e^T
//
// On "cuda" the FP8 tensor-core GEMMs of cuda/sm90/fp8_gemm.cuh (sm_90a; H and I multiples of 64):
// each 32-block's partial from one FP8 wgmma, scaled and added in ascending K, so the same bits
// for a row wherever it sits and whatever the other rows, but not the CPU's bits (the wgmma's
// partial is not a sequential fp32 sum). On "cpu" the reference arithmetic, bitwise
// swiglu_forward's. The offsets stay in device memory on "cuda" (never read by the host): they
// must be non-decreasing; out-of-range ones are clamped to [0, M]. Rows outside every segment are
// not written.
// The bytes of a row of grouped_forward's h_q: I + I/32 rounded up to 16 (the copy engine reads
// rows at 16-byte strides).
inline std::int64_t hq_row_bytes(std::int64_t inner) {
  return (inner + inner / kBlock + 15) / 16 * 16;
}

struct MxGroupedForwardArgs {
  std::uintptr_t x = 0;          // uint8 MXFP8 rows: H E4M3 bytes then H/32 E8M0 scales per row
  std::int64_t x_row_bytes = 0;  // bytes between x's rows (0: H + H/32); on "cuda" a multiple of 16
  std::uintptr_t offsets = 0;    // int64 [El + 1]
  MxWeight gate, up, down;       // the forward reads data and scales (the normal copies)
  std::uintptr_t out_a = 0;      // bf16 [M, I]
  std::uintptr_t out_b = 0;      // bf16 [M, I]
  std::uintptr_t out_h = 0;      // bf16 [M, I]: required with out_y
  std::uintptr_t out_hq = 0;     // uint8 [M, hq_row_bytes(I)]: Q_I(h) as MXFP8 rows (I E4M3
                                 // bytes, then I/32 scales), required with out_y
  std::uintptr_t out_y = 0;      // bf16 [M, H], or 0: a and b only
  MxExpertShape shape;
  SwigluLimit limit;
  std::int64_t num_sms = 0;      // CUDA: most CTAs per GEMM (0: every SM)
  std::int64_t num_threads = 1;  // CPU threads
};

// grouped_gemm: one MXFP8 grouped GEMM over experts' segments of rows, out[rows of e] =
// A[rows of e] @ B_e^T, both operands quantized along K (the orientation of the forward and of
// the input gradients):
//
//   g  = dy_q @ Q_H(Wd_e^T)^T                   B: Wd's transposed copy [El, I, H] (N = I, K = H)
//   dx = Q_2I([d_a, d_b]) @ [Q_I(Wg_e^T); Q_I(Wu_e^T)]^T   K split: Wg's then Wu's transposed
//                                               copies [El, H, I] (N = H, K = 2I, k_split = I)
//
// Each output element is the fp32 sum of its 32-blocks' partials in ascending K (docs/mxfp8.md
// "Arithmetic"), rounded to bf16 or stored as fp32. Devices, offsets and rows outside every
// segment as in grouped_forward.
//
// With a K split, A's rows hold the first K0 elements at columns [0, K0) and the other K - K0
// from column split_a_offset(K0) = K0 rounded up to 128 on (the GPU's stages are 128 deep, so
// the second weight's start in A), the columns between unread: split_a_cols(K, K0) data bytes,
// then that many over 32 scale bytes (those of the unread columns unread too). K0 a multiple of
// 128 leaves no gap.
inline std::int64_t split_a_offset(std::int64_t k_split) { return (k_split + 127) / 128 * 128; }
inline std::int64_t split_a_cols(std::int64_t k, std::int64_t k_split) {
  return k_split == 0 ? k : split_a_offset(k_split) + (k - k_split);
}

struct MxGroupedGemmArgs {
  std::uintptr_t a = 0;          // uint8 MXFP8 rows: K_A E4M3 bytes then K_A/32 E8M0 scales per
                                 // row, K_A = split_a_cols(K, k_split) (K without a split)
  std::int64_t a_row_bytes = 0;  // bytes between A's rows (0: K_A + K_A/32); on "cuda" a multiple
                                 // of 16
  std::uintptr_t offsets = 0;    // int64 [El + 1]
  std::uintptr_t b0_data = 0;    // uint8 E4M3 [El, N, K0]: B's first (or only) weight
  std::uintptr_t b0_scales = 0;  // uint8 E8M0 [El, K0/32, N]
  std::uintptr_t b1_data = 0;    // with k_split: the second weight, [El, N, K - K0]
  std::uintptr_t b1_scales = 0;  // [El, (K - K0)/32, N]
  std::int64_t k_split = 0;      // K0 (0: one weight, K0 = K); on "cuda" a multiple of 64
  std::uintptr_t out = 0;        // [M, N]: bf16, or fp32 with out_fp32
  bool out_fp32 = false;
  std::int64_t num_rows = 0;     // M
  std::int64_t n = 0;            // N
  std::int64_t k = 0;            // K, a multiple of 32 (of 64 on "cuda")
  std::int64_t num_experts = 0;  // El
  std::int64_t num_sms = 0;      // CUDA: most CTAs (0: every SM)
  std::int64_t num_threads = 1;  // CPU threads
};

// grouped_wgrad: the weight-gradient orientation, rows (tokens) as the reduction:
//
//   out_e [R, C] = carry_e + sum over 32-row blocks of segment e of Q_rows(A)^T Q_rows(B)
//
//   dWd_e        : A = bf16(w dy) [M, H], B = h [M, I]          (R = H, C = I)
//   d[Wg; Wu]_e  : A = [d_a, d_b] [M, 2I], B = x [M, H]        (R = 2I, C = H)
//
// Both operands as transposed copies quantized along the rows (mok's quantizer's transposed
// output): A^T E4M3 [R, M] with scales [M/32, R], B^T E4M3 [C, M] with scales [M/32, C].
// Offsets as in grouped_forward, each a multiple of 32 (a 32-row block holds one expert's rows).
// Each output element is the fp32 sum, from the carry (or +0), of its blocks' partials in row
// order: a split of the rows at multiples of 32 into calls that carry the fp32 sums gives the
// bits of one call. Written: out_f32 and/or out_bf16 ([El, R, C]; carry may be out_f32).
struct MxGroupedWgradArgs {
  std::uintptr_t a_data = 0;    // uint8 E4M3 [R, M] (rows a_row_bytes apart; 0: M)
  std::uintptr_t a_scales = 0;  // uint8 E8M0 [M/32, R]
  std::int64_t a_row_bytes = 0;
  std::uintptr_t b_data = 0;    // uint8 E4M3 [C, M]
  std::uintptr_t b_scales = 0;  // uint8 E8M0 [M/32, C]
  std::int64_t b_row_bytes = 0;
  std::uintptr_t offsets = 0;   // int64 [El + 1]
  std::uintptr_t carry = 0;     // fp32 [El, R, C] added to, or 0
  std::uintptr_t out_f32 = 0;   // fp32 [El, R, C] or 0
  std::uintptr_t out_bf16 = 0;  // bf16 [El, R, C] or 0
  std::int64_t num_rows = 0;    // M, a multiple of 32
  std::int64_t r = 0;           // R, a multiple of 64
  std::int64_t c = 0;           // C, a multiple of 64
  std::int64_t num_experts = 0;
  std::int64_t num_sms = 0;
  std::int64_t num_threads = 1;
};

// grouped_swiglu_backward: the element pass of the backward between its GEMMs, on M rows (a
// multiple of 32; the row blocks of the transposed copies count from the call's first row). From g
// = dy_q @ Q(Wd_e) (fp32, unweighted; grouped_gemm), the pre-activations a, b and the router
// weights w:
//
//   h, d_a, d_b                  swiglu_backward of expert_math.h (the reference's bits)
//   d_w = <g, h>                 fp32, the sequential sum of fl(g_i h_i) in ascending i
//   out_dab                      Q_2I([d_a, d_b]): dx's A, MXFP8 rows in grouped_gemm's split
//                                layout with k_split = I (d_b from column split_a_offset(I) on)
//   dab_t, h_t                   d_a, d_b and h quantized along the rows: dWg's, dWu's and dWd's
//                                operands (E4M3 [2I, M]: d_a's rows then d_b's, E8M0 [2, M/32, I]:
//                                d_a's then d_b's; h: [I, M], [M/32, I])
//   x_t, wdy_t                   bf16(x) and bf16(w dy) of the MXFP8 rows x, dy, quantized along
//                                the rows (E4M3 [H, M], E8M0 [M/32, H])
//
// Every bit is what mok-torch's PyTorch composition gives (swiglu_backward_rows, pack_rows,
// mxfp8_quantize(..., normal=False)) but a computed NaN's sign; every row is processed (padding
// rows hold zeros). H and I multiples of 64. "cuda": one CTA per 32-row
// block; "cpu": the same arithmetic in loops, the same bytes.
struct MxSwigluBackwardArgs {
  std::uintptr_t g = 0;               // fp32 [M, I]
  std::uintptr_t a = 0;               // bf16 [M, I]
  std::uintptr_t b = 0;               // bf16 [M, I]
  std::uintptr_t router_weights = 0;  // fp32 [M] or 0 (all ones)
  std::uintptr_t x = 0;               // uint8 MXFP8 rows, x_row_bytes apart (0: H + H/32)
  std::int64_t x_row_bytes = 0;
  std::uintptr_t dy = 0;  // uint8 MXFP8 rows, dy_row_bytes apart (0: H + H/32)
  std::int64_t dy_row_bytes = 0;
  std::uintptr_t out_d_w = 0;      // fp32 [M]
  std::uintptr_t out_dab = 0;      // uint8 [M, dab_row_bytes]
  std::int64_t dab_row_bytes = 0;  // 0: K_A + K_A/32, K_A = split_a_cols(2I, I)
  std::uintptr_t dab_t_data = 0, dab_t_scales = 0;
  std::uintptr_t h_t_data = 0, h_t_scales = 0;
  std::uintptr_t x_t_data = 0, x_t_scales = 0;
  std::uintptr_t wdy_t_data = 0, wdy_t_scales = 0;
  std::int64_t num_rows = 0;  // M
  std::int64_t hidden = 0;    // H
  std::int64_t inner = 0;     // I
  SwigluLimit limit;
  std::int64_t num_threads = 1;  // CPU threads
};

inline constexpr std::int64_t kMaxExpertThreads = 1024;

// device "cpu" (or "cuda": not implemented yet, raises std::runtime_error). Bad arguments raise
// std::invalid_argument naming them.
void swiglu_forward(const std::string& device, const MxForwardArgs& args, std::uintptr_t stream);
void swiglu_backward(const std::string& device, const MxBackwardArgs& args, std::uintptr_t stream);

void grouped_forward(const std::string& device, const MxGroupedForwardArgs& args,
                     std::uintptr_t stream);

void grouped_gemm(const std::string& device, const MxGroupedGemmArgs& args, std::uintptr_t stream);
void grouped_wgrad(const std::string& device, const MxGroupedWgradArgs& args,
                   std::uintptr_t stream);
void grouped_swiglu_backward(const std::string& device, const MxSwigluBackwardArgs& args,
                             std::uintptr_t stream);

void swiglu_forward_cpu(const MxForwardArgs& args);
void grouped_forward_cpu(const MxGroupedForwardArgs& args);
void grouped_gemm_cpu(const MxGroupedGemmArgs& args);
void grouped_wgrad_cpu(const MxGroupedWgradArgs& args);
void grouped_swiglu_backward_cpu(const MxSwigluBackwardArgs& args);
// The GPU implementations (cuda/*.cu); without CUDA they raise std::runtime_error saying so.
void grouped_forward_cuda(const MxGroupedForwardArgs& args, std::uintptr_t stream);
void grouped_gemm_cuda(const MxGroupedGemmArgs& args, std::uintptr_t stream);
void grouped_wgrad_cuda(const MxGroupedWgradArgs& args, std::uintptr_t stream);
void grouped_swiglu_backward_cuda(const MxSwigluBackwardArgs& args, std::uintptr_t stream);
void swiglu_backward_cpu(const MxBackwardArgs& args);

}  // namespace mok::mxfp8
