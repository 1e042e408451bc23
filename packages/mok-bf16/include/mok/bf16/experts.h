// The routed SwiGLU experts on rows of the schedule table (docs/design.md §2), in BF16: the entry
// points mok-torch's native backends call between the pulls and the pushes.
//
// Shape letters: docs/design.md §1 (M: the rows of a call). Rows are flat, each with its own
// local expert (the "PerRow" layout of mok_torch/spec/experts.py): a row is one
// route placed in an expert's input; a row whose expert is -1 is padding (alignment, or past
// the last segment), which no output reads. Weights use the nn.Linear convention:
//
//   w_gate, w_up: bf16 [El, I, H]     w_down: bf16 [El, H, I]
//
// Every result is bitwise what the reference backend computes for the same rows
// (docs/determinism.md): each GEMM element reduces sequentially in ascending order from +0 in
// fp32 (bf16 operands, so every product is exact), every other product is rounded before its
// add, exp is the reference's float64 polynomial, and conversions to bf16 round to nearest
// even. The per-element math lives in mok/bf16/expert_math.h, shared by the CPU and CUDA code.
//
// Pointers are addresses (a tensor's data_ptr()), in host memory for "cpu" and device memory
// for "cuda"; 0 means "none" where allowed, and is allowed for any array the call does not
// touch (no rows, or a zero dimension). Arrays are dense and row-major; outputs must not
// overlap inputs. Calls never allocate device memory and never read device values on the host.
#pragma once

#include <cstdint>
#include <string_view>

#include "mok/bf16/expert_math.h"
#include "mok/core/entry_points.h"  // EntryPoints, TableArgs, CombineArgs

namespace mok::bf16 {

// Most threads a CPU call may start.
inline constexpr std::int64_t kMaxThreads = 1024;

struct ExpertShape {
  std::int64_t num_rows = 0;     // M >= 0
  std::int64_t hidden = 0;       // H >= 0
  std::int64_t inner = 0;        // I >= 0
  std::int64_t num_experts = 0;  // El >= 1
};

// swiglu_forward: the pre-activations of every row, and optionally the expert output rows.
//
//   [a, b] = x @ [Wg_e; Wu_e]^T        (reduction over H ascending, rounded to bf16)
//   y      = h @ Wd_e^T                (reduction over I ascending, rounded to bf16)
//   h      = bf16((a_c * sigmoid(a_c)) * b_c)
//
// Padding rows get a = b = y = 0.
struct SwigluForwardArgs {
  std::uintptr_t x = 0;        // bf16 [M, H]
  std::uintptr_t experts = 0;  // int64 [M]: local expert of each row in [0, El), or -1: padding
  std::uintptr_t w_gate = 0;   // bf16 [El, I, H]
  std::uintptr_t w_up = 0;     // bf16 [El, I, H]
  std::uintptr_t w_down = 0;   // bf16 [El, H, I]; may be 0 when out_y is 0
  std::uintptr_t out_a = 0;    // bf16 [M, I]
  std::uintptr_t out_b = 0;    // bf16 [M, I]
  std::uintptr_t out_y = 0;    // bf16 [M, H], or 0: only a and b (recomputing the saved context)
  ExpertShape shape;
  SwigluLimit limit;             // the optional clamp
  std::int64_t num_threads = 1;  // CPU threads over rows, in [1, kMaxThreads]
};

// swiglu_backward: the per-row gradients, and the weight gradients accumulated in place.
//
//   g   = dy @ Wd_e                    (unweighted, fp32, reduction over H ascending)
//   d_w = sum_i fl(g_i * h_i)          (i ascending: the router-weight gradient, no division)
//   d_a, d_b as in mok/bf16/expert_math.h swiglu_backward, rounded to bf16
//   dx  = [d_a, d_b] @ [Wg_e; Wu_e]    (reduction over 2I ascending, gate part first; bf16)
//   acc_down[e]    += sum_r bf16(w_r dy_r)^T h_r     (rows r of expert e in ascending order)
//   acc_gate_up[e] += sum_r [d_a_r, d_b_r]^T x_r
//
// The accumulators carry across calls, so backward over rows [0, m) then [m, M) gives the bits
// of one call over [0, M) (each expert's rows must come in ascending order over the calls).
// Padding rows get dx = 0 and d_w = 0 and add nothing (the reference's zero rows add exact
// zeros to accumulators that start at +0).
struct SwigluBackwardArgs {
  std::uintptr_t x = 0;               // bf16 [M, H]: the rows' inputs
  std::uintptr_t a = 0;               // bf16 [M, I]: saved or recomputed pre-activations
  std::uintptr_t b = 0;               // bf16 [M, I]
  std::uintptr_t dy = 0;              // bf16 [M, H]: output gradient of each row's token
  std::uintptr_t router_weights = 0;  // fp32 [M]: w of each row, or 0: all ones (unweighted)
  std::uintptr_t experts = 0;         // int64 [M], as in the forward
  std::uintptr_t w_gate = 0;          // bf16 [El, I, H]
  std::uintptr_t w_up = 0;            // bf16 [El, I, H]
  std::uintptr_t w_down = 0;          // bf16 [El, H, I]
  std::uintptr_t out_dx = 0;          // bf16 [M, H]
  std::uintptr_t out_d_w = 0;         // fp32 [M]: router-weight gradient of each row
  std::uintptr_t acc_gate_up = 0;     // fp32 [El, 2I, H]: d[Wg; Wu], gate rows first (in place)
  std::uintptr_t acc_down = 0;        // fp32 [El, H, I]: dWd (in place)
  ExpertShape shape;
  SwigluLimit limit;
  std::int64_t num_threads = 1;  // CPU threads: over rows, then over experts' output blocks
};

// grouped_forward: the forward over experts' segments of consecutive rows, the layout of the
// schedule table (docs/design.md §6): rows [offsets[e], offsets[e+1]) belong to local expert e.
//
//   [a, b] = x @ [Wg_e; Wu_e]^T,  h = bf16(silu(a_c) * b_c),  y = h @ Wd_e^T
//
// On "cuda" these are the tensor-core GEMMs (cuda/sm90/grouped_gemm.cuh): each element an fp32 sum
// over K in one fixed order (blocks of 64, wgmma k16 steps ascending), then rounded to bf16;
// not the reference's sequential sum, but the same bits for a row wherever it sits, whatever
// the other rows, the grid or the SM count. h is the reference's element math applied to a and
// b (an elementwise kernel of its own). On "cpu" the reference arithmetic (as swiglu_forward).
// The offsets stay in device memory on "cuda" (never read by the host), so they are not
// checked there: they must be non-decreasing; out-of-range ones are clamped to [0, M], and
// decreasing ones give unspecified values in the rows they name, never an access outside the
// arrays. Rows outside every segment are not written.
struct GroupedForwardArgs {
  std::uintptr_t x = 0;        // bf16 [M, H]
  std::uintptr_t offsets = 0;  // int64 [El + 1]: segment starts, non-decreasing, in [0, M]
  std::uintptr_t w_gate = 0;   // bf16 [El, I, H]
  std::uintptr_t w_up = 0;     // bf16 [El, I, H]
  std::uintptr_t w_down = 0;   // bf16 [El, H, I]; may be 0 when out_y is 0
  std::uintptr_t out_a = 0;    // bf16 [M, I]
  std::uintptr_t out_b = 0;    // bf16 [M, I]
  std::uintptr_t out_h = 0;    // bf16 [M, I]; required when out_y is given (the down GEMM's A)
  std::uintptr_t out_y = 0;    // bf16 [M, H], or 0
  ExpertShape shape;
  SwigluLimit limit;
  std::int64_t num_sms = 0;      // CUDA: most CTAs per GEMM (0: every SM of the device)
  std::int64_t num_threads = 1;  // CPU threads
  bool zero_outside = false;     // also zero the outputs' rows outside every segment
};

// grouped_backward: the backward over experts' segments (the layout of grouped_forward).
//
//   g = dy @ Wd_e (fp32),  d_w = <g, h>,  d_a, d_b as swiglu_backward,
//   dx = [d_a, d_b] @ [Wg_e; Wu_e],
//   dWg_e = C + sum_r d_a_r^T x_r,  dWu_e = C + sum_r d_b_r^T x_r,
//   dWd_e = C + sum_r bf16(w_r dy_r)^T h_r  ("cpu", the reference's)
//         = C + sum_r dy_r^T bf16(w_r h_r)  ("cuda": the router weight on h's side)
//
// The weight gradients: C is the fp32 accumulator's value when carry_in (else +0, and the
// accumulator is not read); the sums go to the fp32 accumulators (acc_*) when given and, rounded
// to bf16, to out_* when given (so the last of several calls can hand out bf16 gradients
// without another pass). Each of the three needs its accumulator or its output or both. Every
// expert's gradients are written, those of experts without rows too (C).
//
// On "cuda": tensor-core GEMMs (cuda/sm90/experts_backward.cu). g, dx: as grouped_forward's GEMMs
// (a row's bits depend only on the row). d_w: each lane of a warp sums its elements (8-element
// pieces l, l + 32, ... of the row, ascending), then a butterfly over the lanes; the element
// math is the reference's. Weight gradients: the sums start from C and take the expert's rows
// in 64-row blocks from the segment start, the last block zero-padded; two calls over rows
// split at a multiple of 64 from each segment start (the second with carry_in) give the bits of
// one call. The scratch arrays hold g, bf16(w h) and [d_a, d_b] between the kernels (hw and
// d_ab required on "cuda"; g required where I > kGSwigluMaxInner, else written only where given;
// all unused on "cpu"). On "cpu": the reference arithmetic (swiglu_backward on each segment's
// rows). Rows outside every segment are not written and add nothing; offsets as in
// grouped_forward.
//
// The widest I at which the GPU backward runs the SwiGLU backward in the g GEMM's epilogue (a
// row's columns one tile: cuda/sm90/g_swiglu.cuh), so that g needs no array; above it g is
// stored and a kernel of its own reads it back.
inline constexpr std::int64_t kGSwigluMaxInner = 256;

struct GroupedBackwardArgs {
  std::uintptr_t x = 0;               // bf16 [M, H]
  std::uintptr_t offsets = 0;         // int64 [El + 1]
  std::uintptr_t a = 0;               // bf16 [M, I]
  std::uintptr_t b = 0;               // bf16 [M, I]
  std::uintptr_t dy = 0;              // bf16 [M, H]
  std::uintptr_t router_weights = 0;  // fp32 [M] (with weight_route: [num_routes]), or 0: ones
  std::uintptr_t w_gate = 0;          // bf16 [El, I, H]
  std::uintptr_t w_up = 0;            // bf16 [El, I, H]
  std::uintptr_t w_down = 0;          // bf16 [El, H, I]
  std::uintptr_t out_dx = 0;          // bf16 [M, H]; may be dy itself (on "cuda" dWd, dy's
                                      // last reader, runs before dx's GEMM)
  std::uintptr_t out_d_w = 0;         // fp32 [M] (may be 0 with out_d_w_routes)
  std::uintptr_t acc_gate = 0;        // fp32 [El, I, H], or 0 (then out_gate)
  std::uintptr_t acc_up = 0;          // fp32 [El, I, H], or 0 (then out_up)
  std::uintptr_t acc_down = 0;        // fp32 [El, H, I], or 0 (then out_down)
  std::uintptr_t out_gate = 0;        // bf16 [El, I, H], or 0
  std::uintptr_t out_up = 0;          // bf16 [El, I, H], or 0
  std::uintptr_t out_down = 0;        // bf16 [El, H, I], or 0
  bool carry_in = true;               // start from the accumulators' values (they must be given)
  std::uintptr_t scratch_g = 0;       // fp32 [M, I]   (cuda; optional at I <= kGSwigluMaxInner)
  std::uintptr_t scratch_hw = 0;      // bf16 [M, I]   (cuda): bf16(w h)
  std::uintptr_t scratch_d_ab = 0;    // bf16 [M, 2I]  (cuda)
  ExpertShape shape;
  SwigluLimit limit;
  std::int64_t num_sms = 0;      // CUDA: most CTAs per kernel (0: every SM)
  std::int64_t num_threads = 1;  // CPU threads
  bool zero_outside = false;     // also zero out_dx's and out_d_w's rows outside every segment
  // Optional (cuda): int32 [M], each row's route (-1: a padding row). Given, row r's router
  // weight is router_weights[weight_route[r]] ([num_routes], the routes' weights; 0 for a route
  // outside [0, num_routes)): no copy of the weights in table order is made.
  std::uintptr_t weight_route = 0;
  std::int64_t num_routes = 0;
  // Optional, with weight_route: bf16 [num_routes / topk, H], the token rows. Given, row r's dy is
  // dy_tokens[weight_route[r] / topk] (zeros for a route outside [0, num_routes)), read by the
  // kernels themselves (the g GEMM's producers, and dWd's where dwd_gather says so), and `dy` is
  // not read: scratch, given those rows in table order where dWd reads a copy; it may be out_dx.
  std::uintptr_t dy_tokens = 0;
  std::int64_t topk = 1;
  // With dy_tokens (cuda): whether dWd gathers dy's rows itself instead of reading a table-ordered
  // copy the g GEMM stores. -1: where C has one column tile (I <= 256: each row gathered once) and
  // the device's memory bandwidth is below 4 TB/s (there the copy's bytes cost more than the
  // gather loses: NOTES.md, sessions 42-43); 0: never; 1: always (at any I: each column tile
  // gathers the rows). The bits are the same either way.
  std::int64_t dwd_gather = -1;
  // Optional (cuda), with weight_route: bf16 [num_routes / topk, H], the token rows x's table rows
  // came from (x_tokens[weight_route[r] / topk]; zeros for a route outside [0, num_routes)).
  std::uintptr_t x_tokens = 0;
  // How the weight gradients dWg, dWu are computed (cuda; the bits are the same in every mode):
  // 0: C = [d_a, d_b]^T x, [2I, H] tiles; 1: C^T = x^T [d_a, d_b], [H, 2I] tiles stored
  // transposed, x from its table-ordered rows; 2: as 1 with x's rows gathered from x_tokens by
  // dW1's producers (`x` not read).
  std::int64_t dw1_mode = 0;
  // Optional (cuda), with weight_route: fp32 [num_routes]. Given, each row's d_w is also stored
  // at its route (route order: the router weights' gradient, no gather from table order); a
  // route no row lists is not written. out_d_w may then be 0 (no table-ordered d_w), unless
  // zero_outside.
  std::uintptr_t out_d_w_routes = 0;
};

// moe_forward: the routed experts of a whole layer call in one call, from the token rows to one
// output row per route (on "cuda" one persistent launch: cuda/sm90/moe_forward.cu,
// docs/megakernel.md; on "cpu" the same rows through the CPU kernels, the protocol's host model):
//
//   for every row r of local expert e's segment (the schedule table; route = row_route[r]):
//     x_r = x[route / K] (a padding row, route -1, reads zeros),
//     [a, b] = x_r @ [Wg_e; Wu_e]^T,  h = bf16(silu(a_c) * b_c),  y_r = h @ Wd_e^T,
//     rows_out[route] = y_r (padding rows go nowhere)
//
// with grouped_forward's arithmetic on the device (the same bits). Across ranks (world_size > 1)
// row r's source is rank row_src[r]: x_r is row route / K of that rank's token rows and y_r goes
// to row `route` of that rank's output rows, read and written where they are (x_ranks,
// out_rows_ranks: each rank's address, 16-byte aligned, as the transport maps its peers'
// segments; on "cuda" the kernel's gather reads them and its down tiles store to them by that
// address, so a row costs one more load, its source rank; the caller's barriers order them: the
// sources' rows written before, the outputs read after). A
// route outside [0, num_tokens * K) or a source outside [0, world_size) is a padding row (no
// token row is read, nothing is stored), as a route of -1. a and b are written for every row
// (rows outside the segments: zero); h is scratch. offsets: int32 [El + 1] and row_route: int32
// [C], the schedule table's (on "cuda" read on the device only; on "cpu" the offsets are checked
// first). task_state: moe_forward_state_bytes(C, El) bytes of device memory, zero before the
// first call; every call leaves it zero. A task that waits longer than timeout_ns for the tiles
// it depends on records a timeout in `error` (the transport's error words, with `stage` and
// `rank`) and the launch still ends. On "cpu" nothing waits: task_state and error are not used.
struct MoeForwardArgs {
  std::uintptr_t x = 0;          // bf16 [T, H]: the token rows
  std::uintptr_t row_route = 0;  // int32 [C]: route t*K + k of each table row, -1 for padding
  std::uintptr_t offsets = 0;    // int32 [El + 1]: segment starts, non-decreasing, in [0, C]
  std::uintptr_t w_gate = 0;     // bf16 [El, I, H]
  std::uintptr_t w_up = 0;       // bf16 [El, I, H]
  std::uintptr_t w_down = 0;     // bf16 [El, H, I]
  std::uintptr_t out_a = 0;      // bf16 [C, I]
  std::uintptr_t out_b = 0;      // bf16 [C, I]
  std::uintptr_t scratch_h = 0;  // bf16 [C, I]
  std::uintptr_t out_rows = 0;   // bf16 [T * K, H]: one row per route
  // bf16 [C, H]: each table row's x (zeros for padding rows and past the last segment), the
  // backward's routed x; or 0: not stored.
  std::uintptr_t out_x = 0;
  std::uintptr_t task_state = 0;  // moe_forward_state_bytes(C, El) bytes, 8-byte aligned
  std::uintptr_t error = 0;       // int32 [4]: the transport's error words
  ExpertShape shape;              // num_rows = C (the table's capacity)
  std::int64_t num_tokens = 0;    // T
  std::int64_t topk = 0;          // K
  SwigluLimit limit;
  std::int64_t num_sms = 0;  // CTAs of the launch (0: every SM of the device)
  std::int64_t timeout_ns = 0;
  std::int64_t stage = 0;  // reported with a timeout
  std::int64_t rank = 0;
  bool inject_missing_dependency = false;  // tests: one row tile's down tiles wait forever
  // A probe's per-CTA time accounts (uint64 [CTAs][3][9]: cuda/sm90/moe_forward.cu's Timer), or 0:
  // the untimed kernel.
  std::uintptr_t timers = 0;
  // Across ranks (world_size > 1): int32 [C] each table row's source rank (the table's row_src),
  // int64 [world_size] the address of each rank's token rows (bf16 [>= num_tokens, H]) and of its
  // output rows (bf16 [>= num_tokens * K, H]), 16-byte aligned (on "cuda" in device memory); x
  // and out_rows are then not read, and timers must be 0. num_tokens is then the most tokens a
  // rank brings (every rank's routes below num_tokens * K).
  std::int64_t world_size = 1;
  std::uintptr_t row_src = 0;
  std::uintptr_t x_ranks = 0;
  std::uintptr_t out_rows_ranks = 0;
  std::int64_t num_threads = 1;  // CPU threads
};

// The dependency counters of moe_forward: one per row tile of the table, at most C/128 + El.
inline constexpr std::int64_t moe_forward_counters(std::int64_t capacity,
                                                   std::int64_t num_experts) {
  return (capacity + 127) / 128 + num_experts;
}
// Bytes of moe_forward's task state: the ticket queue (8 bytes), then the counters.
inline constexpr std::int64_t moe_forward_state_bytes(std::int64_t capacity,
                                                      std::int64_t num_experts) {
  return 8 + 4 * moe_forward_counters(capacity, num_experts);
}

// Largest El of grouped_forward on "cuda" (the tile list lives in shared memory).
inline constexpr std::int64_t kMaxGroupedExperts = 1024;

// Checked calls. `device` is "cpu" or "cuda"; `stream` a cudaStream_t as an integer (unused on
// the CPU). Throw std::invalid_argument (Python ValueError) naming a bad argument, and
// std::runtime_error where "cuda" has no kernels (the per-row swiglu_* entry points; the GPU
// has the grouped_* ones) or the build has no CUDA. On "cpu" the expert ids or offsets are
// checked before anything is written.
void swiglu_forward(std::string_view device, const SwigluForwardArgs& args, std::uintptr_t stream);
void swiglu_backward(std::string_view device, const SwigluBackwardArgs& args,
                     std::uintptr_t stream);
void grouped_forward(std::string_view device, const GroupedForwardArgs& args,
                     std::uintptr_t stream);
void grouped_backward(std::string_view device, const GroupedBackwardArgs& args,
                      std::uintptr_t stream);

void moe_forward(std::string_view device, const MoeForwardArgs& args, std::uintptr_t stream);

// moe_backward: the routed experts' backward of a whole layer call in one call, from each route's
// dy and router weight where its source rank keeps them to one dx row and one d_router value per
// route where that rank reads them (the mirror of moe_forward; the protocol a backward megakernel
// across ranks would take: each table row read from its source rank by address, each result
// stored into that rank's arrays, no row moved into table order by the transport):
//
//   for every row r of local expert e's segment (route = row_route[r], source s = row_src[r]):
//     dy_r = dy_s[route / K], w_r = router_weights_s[route] (a padding row: zeros, weight 0),
//     grouped_backward's arithmetic on the table's rows (x, a, b: the forward's context),
//     out_dx_rows_s[route] = dx_r, out_d_router_s[route] = d_w_r (padding rows go nowhere),
//
// the weight gradients this rank's experts' (C carried in, or +0, as grouped_backward). At one
// rank (world_size 1) s is 0 and the arrays are dy, router_weights, out_dx_rows and
// out_d_router; across ranks they are the ranks' addresses in dy_ranks, weights_ranks,
// out_dx_rows_ranks and out_d_router_ranks (int64 [world_size] each, as the transport maps its
// peers' segments; the caller's barriers order them: the sources' rows written before, the
// results read after), and a route outside [0, num_tokens * K) or a source outside [0,
// world_size) is a padding row. router_weights 0 (one rank): every weight 1. out_d_router(_ranks)
// 0: d_router not stored. The bits are those of grouped_backward on the same rows in table order
// ("cpu": the reference arithmetic), whatever num_threads. "cpu" only: on "cuda" one rank's
// backward is moe_backward_call; the kernels do not take per-rank arguments yet.
struct MoeBackwardArgs {
  std::uintptr_t x = 0;               // bf16 [C, H]: each table row's x (moe_forward's out_x)
  std::uintptr_t a = 0;               // bf16 [C, I]
  std::uintptr_t b = 0;               // bf16 [C, I]
  std::uintptr_t row_route = 0;       // int32 [C]
  std::uintptr_t offsets = 0;         // int32 [El + 1]: segment starts, non-decreasing, in [0, C]
  std::uintptr_t w_gate = 0;          // bf16 [El, I, H]
  std::uintptr_t w_up = 0;            // bf16 [El, I, H]
  std::uintptr_t w_down = 0;          // bf16 [El, H, I]
  std::uintptr_t dy = 0;              // bf16 [T, H] (one rank)
  std::uintptr_t router_weights = 0;  // fp32 [T * K] (one rank), or 0: ones
  std::uintptr_t out_dx_rows = 0;     // bf16 [T * K, H] (one rank): one dx row per route
  std::uintptr_t out_d_router = 0;    // fp32 [T * K] (one rank), or 0
  std::uintptr_t acc_gate = 0;        // fp32 [El, I, H], or 0 (then out_gate)
  std::uintptr_t acc_up = 0;          // fp32 [El, I, H], or 0 (then out_up)
  std::uintptr_t acc_down = 0;        // fp32 [El, H, I], or 0 (then out_down)
  std::uintptr_t out_gate = 0;        // bf16 [El, I, H], or 0
  std::uintptr_t out_up = 0;          // bf16 [El, I, H], or 0
  std::uintptr_t out_down = 0;        // bf16 [El, H, I], or 0
  bool carry_in = false;              // start from the accumulators' values
  ExpertShape shape;                  // num_rows = C (the table's capacity)
  std::int64_t num_tokens = 0;        // T (across ranks: the most tokens a rank brings)
  std::int64_t topk = 0;              // K
  SwigluLimit limit;
  std::int64_t world_size = 1;
  std::uintptr_t row_src = 0;             // int32 [C] (world_size > 1)
  std::uintptr_t dy_ranks = 0;            // int64 [world_size]: bf16 [>= T, H] each
  std::uintptr_t weights_ranks = 0;       // int64 [world_size]: fp32 [>= T * K] each
  std::uintptr_t out_dx_rows_ranks = 0;   // int64 [world_size]: bf16 [>= T * K, H] each
  std::uintptr_t out_d_router_ranks = 0;  // int64 [world_size]: fp32 [>= T * K] each, or 0
  std::int64_t num_threads = 1;           // CPU threads
};
void moe_backward(std::string_view device, const MoeBackwardArgs& args, std::uintptr_t stream);

// One rank's forward in one call from Python (docs/megakernel.md, "The host"): mok-core's schedule
// table from the routes in place (`table`: local_routes, world_size 1), then moe_forward on it
// (`experts`: its row_route and offsets the table's, its rows the combine's), then mok-core's
// combine of the routes' rows (`combine`: its rows `experts.out_rows`, no row index), all on
// `stream`, the table and the combine through mok-core's entry points (`core`, checked:
// core/entry_points.h). On "cpu" the experts run the table's rows in use, read on the host after
// its build (nothing of a context: out_a, out_b and out_x must be 0 there); on "cuda" nothing is
// read on the host. Each step's checks are its own call's (std::invalid_argument naming the bad
// argument, before that step writes anything).
struct MoeForwardCallArgs {
  core::TableArgs table;
  MoeForwardArgs experts;
  core::CombineArgs combine;
};
void moe_forward_call(const core::EntryPoints& core, std::string_view device,
                      MoeForwardCallArgs args, std::uintptr_t stream);

// One rank's direct backward in one call from Python (docs/megakernel.md, "The host"), on "cuda":
// the table's int32 offsets (`offsets32`, [El + 1]) widened into `experts.offsets` (int64, the
// GEMMs'), then grouped_backward (`experts`: dy gathered by route from dy_tokens, each row's
// weight read by route, d_w stored by route into out_d_w_routes, which is zeroed first so that a
// route no row lists reads 0; out_dx the table-ordered dy rows themselves), then mok-core's
// combine of dx (`combine`: its rows experts.out_dx through the routes' rows, row_index, with no
// weights; with combine.error_mirror it publishes the error words), all on `stream`. Each step's
// checks are its own call's.
struct MoeBackwardCallArgs {
  std::uintptr_t offsets32 = 0;
  GroupedBackwardArgs experts;
  core::CombineArgs combine;
};
void moe_backward_call(const core::EntryPoints& core, std::string_view device,
                       const MoeBackwardCallArgs& args, std::uintptr_t stream);

// The CPU implementations, for arguments already checked.
void swiglu_forward_cpu(const SwigluForwardArgs& args);
void swiglu_backward_cpu(const SwigluBackwardArgs& args);
void grouped_forward_cpu(const GroupedForwardArgs& args);
void grouped_backward_cpu(const GroupedBackwardArgs& args);
void moe_forward_cpu(const MoeForwardArgs& args);
void moe_backward_cpu(const MoeBackwardArgs& args);
// The CUDA implementations (built with CUDA only), for checked arguments.
void grouped_forward_cuda(const GroupedForwardArgs& args, std::uintptr_t stream);
void grouped_backward_cuda(const GroupedBackwardArgs& args, std::uintptr_t stream);
// moe_backward_call's preparation: offsets64[e] = offsets32[e] for e in [0, num_experts], and
// d_w_routes (fp32 [num_routes]) zeroed.
void moe_backward_prepare_cuda(std::uintptr_t offsets32, std::uintptr_t offsets64,
                               std::int64_t num_experts, std::uintptr_t d_w_routes,
                               std::int64_t num_routes, std::uintptr_t stream);
namespace sm90 {
void moe_forward_cuda(const MoeForwardArgs& args, std::uintptr_t stream);
}

}  // namespace mok::bf16
