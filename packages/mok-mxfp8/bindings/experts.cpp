// Python bindings of the MXFP8 expert entry points (include/mok/mxfp8/experts.h).
#include "mok/mxfp8/experts.h"

#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "mok/core/pybind/swiglu_limit.h"
#include "register.h"

namespace mok::mxfp8::bindings {
namespace {

using Quad = std::array<std::uintptr_t, 4>;

MxWeight weight(const Quad& q) { return {q[0], q[1], q[2], q[3]}; }

}  // namespace

void register_experts(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "swiglu_forward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t experts, const Quad& gate,
         const Quad& up, const Quad& down, std::uintptr_t out_a, std::uintptr_t out_b,
         std::uintptr_t out_y, std::int64_t num_rows, std::int64_t hidden, std::int64_t inner,
         std::int64_t num_experts, std::optional<double> limit, std::int64_t num_threads,
         std::uintptr_t stream) {
        MxForwardArgs a;
        a.x = x;
        a.experts = experts;
        a.gate = weight(gate);
        a.up = weight(up);
        a.down = weight(down);
        a.out_a = out_a;
        a.out_b = out_b;
        a.out_y = out_y;
        a.shape = {num_rows, hidden, inner, num_experts};
        a.limit = core::swiglu_limit("swiglu_forward", limit);
        a.num_threads = num_threads;
        swiglu_forward(device, a, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("experts"), py::arg("gate"), py::arg("up"),
      py::arg("down"), py::arg("out_a"), py::arg("out_b"), py::arg("out_y"), py::arg("num_rows"),
      py::arg("hidden"), py::arg("inner"), py::arg("num_experts"), py::arg("limit") = py::none(),
      py::arg("num_threads") = 1, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "MXFP8 SwiGLU expert forward on M table rows (docs/mxfp8.md). x: uint8 MXFP8 rows [M, H + "
      "H/32]; experts: int64 [M] in [-1, El) (-1: padding, zero outputs); gate, up, down: "
      "(data, scales, data_t, scales_t) addresses of mok.mxfp8_quantize's copies of Wg, Wu [El, I, "
      "H] and Wd [El, H, I]. Writes out_a, out_b = bf16 pre-activations [M, I] and, unless out_y "
      "is 0, out_y = bf16(Q_I(h) @ Wd^T) [M, H]. Every reduction in blocks of 32, each block's "
      "partial summed from +0: the reference backend's MXFP8 bits. device 'cpu'; 'cuda' raises "
      "RuntimeError (no GPU kernels yet). Raises ValueError naming a bad argument.");
  m.def(
      "swiglu_backward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t a, std::uintptr_t b,
         std::uintptr_t dy, std::uintptr_t router_weights, std::uintptr_t experts, const Quad& gate,
         const Quad& up, const Quad& down, std::uintptr_t out_dx, std::uintptr_t out_d_w,
         std::uintptr_t acc_gate_up, std::uintptr_t acc_down, std::int64_t num_rows,
         std::int64_t hidden, std::int64_t inner, std::int64_t num_experts,
         std::optional<double> limit, std::int64_t num_threads, std::uintptr_t stream) {
        MxBackwardArgs args;
        args.x = x;
        args.a = a;
        args.b = b;
        args.dy = dy;
        args.router_weights = router_weights;
        args.experts = experts;
        args.gate = weight(gate);
        args.up = weight(up);
        args.down = weight(down);
        args.out_dx = out_dx;
        args.out_d_w = out_d_w;
        args.acc_gate_up = acc_gate_up;
        args.acc_down = acc_down;
        args.shape = {num_rows, hidden, inner, num_experts};
        args.limit = core::swiglu_limit("swiglu_backward", limit);
        args.num_threads = num_threads;
        swiglu_backward(device, args, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("dy"),
      py::arg("router_weights"), py::arg("experts"), py::arg("gate"), py::arg("up"),
      py::arg("down"), py::arg("out_dx"), py::arg("out_d_w"), py::arg("acc_gate_up"),
      py::arg("acc_down"), py::arg("num_rows"), py::arg("hidden"), py::arg("inner"),
      py::arg("num_experts"), py::arg("limit") = py::none(), py::arg("num_threads") = 1,
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "MXFP8 SwiGLU expert backward on M table rows (docs/mxfp8.md). x, dy: MXFP8 rows; a, b: "
      "bf16 [M, I]; router_weights: fp32 [M] or 0 (ones); experts and weights as in "
      "swiglu_forward. Writes out_dx (bf16 [M, H]) and out_d_w (fp32 [M]); adds the weight "
      "gradients to acc_gate_up (fp32 [El, 2I, H]) and acc_down (fp32 [El, H, I]), operands "
      "quantized along rows in 32-row blocks from the call's first row, which must be a table row "
      "at a multiple of 32 (a block holding two experts is an error). Bits as the reference "
      "backend's MXFP8; device and errors as in swiglu_forward.");
  m.def(
      "grouped_forward",
      [](const std::string& device, std::uintptr_t x, std::int64_t x_row_bytes,
         std::uintptr_t offsets, const Quad& gate, const Quad& up, const Quad& down,
         std::uintptr_t out_a, std::uintptr_t out_b, std::uintptr_t out_h, std::uintptr_t out_hq,
         std::uintptr_t out_y, std::int64_t num_rows, std::int64_t hidden, std::int64_t inner,
         std::int64_t num_experts, std::optional<double> limit, std::int64_t num_sms,
         std::int64_t num_threads, std::uintptr_t stream) {
        MxGroupedForwardArgs a;
        a.x = x;
        a.x_row_bytes = x_row_bytes;
        a.offsets = offsets;
        a.gate = weight(gate);
        a.up = weight(up);
        a.down = weight(down);
        a.out_a = out_a;
        a.out_b = out_b;
        a.out_h = out_h;
        a.out_hq = out_hq;
        a.out_y = out_y;
        a.shape = {num_rows, hidden, inner, num_experts};
        a.limit = core::swiglu_limit("grouped_forward", limit);
        a.num_sms = num_sms;
        a.num_threads = num_threads;
        grouped_forward(device, a, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("x_row_bytes"), py::arg("offsets"), py::arg("gate"),
      py::arg("up"), py::arg("down"), py::arg("out_a"), py::arg("out_b"), py::arg("out_h"),
      py::arg("out_hq"), py::arg("out_y"), py::arg("num_rows"), py::arg("hidden"), py::arg("inner"),
      py::arg("num_experts"), py::arg("limit") = py::none(), py::arg("num_sms") = 0,
      py::arg("num_threads") = 1, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "MXFP8 SwiGLU expert forward over segments of consecutive rows (rows [offsets[e], "
      "offsets[e+1]) are local expert e's; offsets int64 [El + 1], non-decreasing). x: uint8 "
      "MXFP8 rows, H E4M3 bytes then H/32 scales, x_row_bytes apart (0: H + H/32); gate, up, "
      "down as in swiglu_forward (the forward reads their normal copies). Writes out_a, out_b "
      "(bf16 [M, I]) and, unless out_y is 0, out_h (bf16 [M, I]), h's MXFP8 copy along I "
      "(out_hq: MXFP8 rows, uint8 [M, hq_row_bytes(I) = I + I/32 rounded up to 16]) and out_y "
      "(bf16 [M, H]); rows "
      "outside every segment are not written. device 'cpu': the reference's bits (the host reads "
      "the offsets); 'cuda': sm_90a FP8 tensor-core GEMMs with per-32 scaling (H and I multiples "
      "of 64, x's rows and arrays 16-byte aligned, the offsets read on the device only), "
      "deterministic and batch invariant, within a tight tolerance of the CPU. num_sms: most CTAs "
      "per GEMM (0: every SM). Raises ValueError naming a bad argument.");
  m.def(
      "grouped_gemm",
      [](const std::string& device, std::uintptr_t a, std::int64_t a_row_bytes,
         std::uintptr_t offsets, std::uintptr_t b0_data, std::uintptr_t b0_scales,
         std::uintptr_t b1_data, std::uintptr_t b1_scales, std::int64_t k_split, std::uintptr_t out,
         bool out_fp32, std::int64_t num_rows, std::int64_t n, std::int64_t k,
         std::int64_t num_experts, std::int64_t num_sms, std::int64_t num_threads,
         std::uintptr_t stream) {
        MxGroupedGemmArgs g;
        g.a = a;
        g.a_row_bytes = a_row_bytes;
        g.offsets = offsets;
        g.b0_data = b0_data;
        g.b0_scales = b0_scales;
        g.b1_data = b1_data;
        g.b1_scales = b1_scales;
        g.k_split = k_split;
        g.out = out;
        g.out_fp32 = out_fp32;
        g.num_rows = num_rows;
        g.n = n;
        g.k = k;
        g.num_experts = num_experts;
        g.num_sms = num_sms;
        g.num_threads = num_threads;
        grouped_gemm(device, g, stream);
      },
      py::arg("device"), py::arg("a"), py::arg("a_row_bytes"), py::arg("offsets"),
      py::arg("b0_data"), py::arg("b0_scales"), py::arg("b1_data"), py::arg("b1_scales"),
      py::arg("k_split"), py::arg("out"), py::arg("out_fp32"), py::arg("num_rows"), py::arg("n"),
      py::arg("k"), py::arg("num_experts"), py::arg("num_sms") = 0, py::arg("num_threads") = 1,
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "One MXFP8 grouped GEMM over segments of consecutive rows: out[rows of e] = A[rows of e] @ "
      "B_e^T, both quantized along K. a: uint8 MXFP8 rows (K E4M3 bytes then K/32 scales, "
      "a_row_bytes apart, 0: K + K/32); B_e: b0 (E4M3 [El, N, K0], scales [El, K0/32, N]) and, "
      "with k_split = K0 > 0, b1 ([El, N, K - K0], [El, (K - K0)/32, N]) for the rest of K; out: "
      "[M, N] bf16, or fp32 with out_fp32. Rows outside every segment are not written. 'cpu': "
      "the reference arithmetic (32-block partials summed in fp32, in K order); 'cuda': the sm_90a "
      "FP8 GEMM with per-32 scaling (n and k multiples of 64, k_split of 128), deterministic and "
      "batch invariant. Raises ValueError naming a bad argument.");
  m.def(
      "grouped_wgrad",
      [](const std::string& device, std::uintptr_t a_data, std::uintptr_t a_scales,
         std::int64_t a_row_bytes, std::uintptr_t b_data, std::uintptr_t b_scales,
         std::int64_t b_row_bytes, std::uintptr_t offsets, std::uintptr_t carry,
         std::uintptr_t out_f32, std::uintptr_t out_bf16, std::int64_t num_rows, std::int64_t r,
         std::int64_t c, std::int64_t num_experts, std::int64_t num_sms, std::int64_t num_threads,
         std::uintptr_t stream) {
        MxGroupedWgradArgs g;
        g.a_data = a_data;
        g.a_scales = a_scales;
        g.a_row_bytes = a_row_bytes;
        g.b_data = b_data;
        g.b_scales = b_scales;
        g.b_row_bytes = b_row_bytes;
        g.offsets = offsets;
        g.carry = carry;
        g.out_f32 = out_f32;
        g.out_bf16 = out_bf16;
        g.num_rows = num_rows;
        g.r = r;
        g.c = c;
        g.num_experts = num_experts;
        g.num_sms = num_sms;
        g.num_threads = num_threads;
        grouped_wgrad(device, g, stream);
      },
      py::arg("device"), py::arg("a_data"), py::arg("a_scales"), py::arg("a_row_bytes"),
      py::arg("b_data"), py::arg("b_scales"), py::arg("b_row_bytes"), py::arg("offsets"),
      py::arg("carry"), py::arg("out_f32"), py::arg("out_bf16"), py::arg("num_rows"), py::arg("r"),
      py::arg("c"), py::arg("num_experts"), py::arg("num_sms") = 0, py::arg("num_threads") = 1,
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "The MXFP8 weight gradients, rows as the reduction: out_e [R, C] = carry_e + sum over the "
      "32-row blocks of segment e of Q_rows(A)^T Q_rows(B), from transposed copies quantized "
      "along the rows: A^T E4M3 [R, M] (scales [M/32, R]), B^T E4M3 [C, M] (scales [M/32, C]), "
      "rows a_row_bytes / b_row_bytes apart (0: M). Offsets int64 [El + 1], non-decreasing, "
      "multiples of 32. carry: fp32 [El, R, C] or 0; writes out_f32 (fp32) and/or out_bf16 "
      "(bf16), [El, R, C] (carry may be out_f32). 'cpu': the reference arithmetic; 'cuda': the "
      "sm_90a FP8 GEMM with per-32 scaling (R and C multiples of 64, rows 16-byte aligned), "
      "deterministic, a split of the rows at multiples of 32 carrying the fp32 sums gives the "
      "bits of one call. Raises ValueError naming a bad argument.");
  m.def(
      "grouped_swiglu_backward",
      [](const std::string& device, std::uintptr_t g, std::uintptr_t a, std::uintptr_t b,
         std::uintptr_t router_weights, std::uintptr_t x, std::int64_t x_row_bytes,
         std::uintptr_t dy, std::int64_t dy_row_bytes, std::uintptr_t out_d_w,
         std::uintptr_t out_dab, std::int64_t dab_row_bytes, std::uintptr_t dab_t_data,
         std::uintptr_t dab_t_scales, std::uintptr_t h_t_data, std::uintptr_t h_t_scales,
         std::uintptr_t x_t_data, std::uintptr_t x_t_scales, std::uintptr_t wdy_t_data,
         std::uintptr_t wdy_t_scales, std::int64_t num_rows, std::int64_t hidden,
         std::int64_t inner, std::optional<double> limit, std::int64_t num_threads,
         std::uintptr_t stream) {
        MxSwigluBackwardArgs s;
        s.g = g;
        s.a = a;
        s.b = b;
        s.router_weights = router_weights;
        s.x = x;
        s.x_row_bytes = x_row_bytes;
        s.dy = dy;
        s.dy_row_bytes = dy_row_bytes;
        s.out_d_w = out_d_w;
        s.out_dab = out_dab;
        s.dab_row_bytes = dab_row_bytes;
        s.dab_t_data = dab_t_data;
        s.dab_t_scales = dab_t_scales;
        s.h_t_data = h_t_data;
        s.h_t_scales = h_t_scales;
        s.x_t_data = x_t_data;
        s.x_t_scales = x_t_scales;
        s.wdy_t_data = wdy_t_data;
        s.wdy_t_scales = wdy_t_scales;
        s.num_rows = num_rows;
        s.hidden = hidden;
        s.inner = inner;
        s.limit = core::swiglu_limit("grouped_swiglu_backward", limit);
        s.num_threads = num_threads;
        grouped_swiglu_backward(device, s, stream);
      },
      py::arg("device"), py::arg("g"), py::arg("a"), py::arg("b"), py::arg("router_weights"),
      py::arg("x"), py::arg("x_row_bytes"), py::arg("dy"), py::arg("dy_row_bytes"),
      py::arg("out_d_w"), py::arg("out_dab"), py::arg("dab_row_bytes"), py::arg("dab_t_data"),
      py::arg("dab_t_scales"), py::arg("h_t_data"), py::arg("h_t_scales"), py::arg("x_t_data"),
      py::arg("x_t_scales"), py::arg("wdy_t_data"), py::arg("wdy_t_scales"), py::arg("num_rows"),
      py::arg("hidden"), py::arg("inner"), py::arg("limit") = py::none(),
      py::arg("num_threads") = 1, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "The MXFP8 backward's element pass between its GEMMs, on M rows (a multiple of 32). From g "
      "(fp32 [M, I], unweighted dy_q @ Q(Wd)), a, b (bf16 [M, I]), router_weights (fp32 [M] or 0: "
      "all ones) and the MXFP8 rows x, dy (H bytes then H/32 scales, *_row_bytes apart, 0: "
      "packed): out_d_w (fp32 [M], <g, h> summed in ascending order), out_dab (uint8 [M, "
      "dab_row_bytes]: "
      "Q_2I([d_a, d_b]) as MXFP8 rows), and the transposed copies quantized along the rows "
      "(E4M3 [C, M], E8M0 [M/32, C]) of d_a and d_b (dab_t: d_a's C = I rows then d_b's, the "
      "scales "
      "[2, M/32, I]), h (C = I), bf16(x) and bf16(w dy) (C = H). h, d_a, d_b: the reference's "
      "SwiGLU backward (limit as in grouped_forward). H and I "
      "multiples of 64; on 'cuda' rows and arrays 16-byte aligned. 'cpu' and 'cuda' give the "
      "reference's bits (a computed NaN's sign aside). Raises ValueError naming a bad argument.");
}

}  // namespace mok::mxfp8::bindings
