// Python bindings of the expert entry points (include/mok/bf16/experts.h).
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "mok/bf16/experts.h"
#include "mok/core/pybind/swiglu_limit.h"
#include "register.h"

namespace mok::bf16::bindings {

namespace {

// mok-core's entry points from the capsule mok_core.entry_points() returns (checked: version and
// argument sizes); std::invalid_argument naming `fn` for any other object.
const core::EntryPoints& entries_of(const pybind11::capsule& capsule, const char* fn) {
  const char* name = capsule.name();
  if (name == nullptr || std::string_view(name) != core::kEntryPointsCapsule) {
    throw std::invalid_argument(std::string(fn) + ": entry_points must be mok_core.entry_points()");
  }
  return core::checked_entry_points(capsule.get_pointer());
}

}  // namespace

void register_experts(pybind11::module_& m) {
  namespace py = pybind11;
  // The widest I whose CUDA backward needs no g array (experts.h's kGSwigluMaxInner).
  m.attr("G_SWIGLU_MAX_INNER") = kGSwigluMaxInner;
  m.def(
      "swiglu_forward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t experts, std::uintptr_t w_gate,
         std::uintptr_t w_up, std::uintptr_t w_down, std::uintptr_t out_a, std::uintptr_t out_b,
         std::uintptr_t out_y, std::int64_t num_rows, std::int64_t hidden, std::int64_t inner,
         std::int64_t num_experts, std::optional<double> limit, std::int64_t num_threads,
         std::uintptr_t stream) {
        SwigluForwardArgs a;
        a.x = x;
        a.experts = experts;
        a.w_gate = w_gate;
        a.w_up = w_up;
        a.w_down = w_down;
        a.out_a = out_a;
        a.out_b = out_b;
        a.out_y = out_y;
        a.shape = {num_rows, hidden, inner, num_experts};
        a.limit = core::swiglu_limit("swiglu_forward", limit);
        a.num_threads = num_threads;
        swiglu_forward(device, a, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("experts"), py::arg("w_gate"), py::arg("w_up"),
      py::arg("w_down"), py::arg("out_a"), py::arg("out_b"), py::arg("out_y"), py::arg("num_rows"),
      py::arg("hidden"), py::arg("inner"), py::arg("num_experts"), py::arg("limit") = py::none(),
      py::arg("num_threads") = 1, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "SwiGLU expert forward on M table rows, each with its own local expert (docs/design.md §2). "
      "x: bf16 [M, H]; experts: int64 [M], each in [0, num_experts) or -1 (a padding row: a, b, y "
      "= 0); w_gate, w_up: bf16 [El, I, H]; w_down: bf16 [El, H, I] (0 allowed when out_y is 0). "
      "Writes out_a = bf16(x @ Wg^T), out_b = bf16(x @ Wu^T) (bf16 [M, I]) and, unless out_y is 0, "
      "out_y = bf16(h @ Wd^T) (bf16 [M, H]) with h = bf16(silu(a_c) * b_c), a_c = min(a, limit), "
      "b_c = clamp(b, -limit, limit) (limit None: no clamp; applied in fp32). Bitwise mok-torch's "
      "reference (gate_up, swiglu, down): each GEMM element is a sequential fp32 sum in ascending "
      "order from +0. Pointers are ints (data_ptr()); 0 is allowed for arrays the call does not "
      "touch. num_threads: CPU threads over rows (the bits do not depend on it). device 'cpu'; "
      "'cuda' raises RuntimeError (no CUDA implementation; on the GPU see grouped_forward). Raises "
      "ValueError naming a bad argument "
      "(sizes, null or misaligned pointers, expert ids, limit, num_threads).");

  m.def(
      "swiglu_backward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t a, std::uintptr_t b,
         std::uintptr_t dy, std::uintptr_t router_weights, std::uintptr_t experts,
         std::uintptr_t w_gate, std::uintptr_t w_up, std::uintptr_t w_down, std::uintptr_t out_dx,
         std::uintptr_t out_d_w, std::uintptr_t acc_gate_up, std::uintptr_t acc_down,
         std::int64_t num_rows, std::int64_t hidden, std::int64_t inner, std::int64_t num_experts,
         std::optional<double> limit, std::int64_t num_threads, std::uintptr_t stream) {
        SwigluBackwardArgs args;
        args.x = x;
        args.a = a;
        args.b = b;
        args.dy = dy;
        args.router_weights = router_weights;
        args.experts = experts;
        args.w_gate = w_gate;
        args.w_up = w_up;
        args.w_down = w_down;
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
      py::arg("router_weights"), py::arg("experts"), py::arg("w_gate"), py::arg("w_up"),
      py::arg("w_down"), py::arg("out_dx"), py::arg("out_d_w"), py::arg("acc_gate_up"),
      py::arg("acc_down"), py::arg("num_rows"), py::arg("hidden"), py::arg("inner"),
      py::arg("num_experts"), py::arg("limit") = py::none(), py::arg("num_threads") = 1,
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "SwiGLU expert backward on M table rows (docs/design.md §2). x, dy: bf16 [M, H]; a, b: bf16 "
      "[M, I] (the forward's pre-activations); router_weights: fp32 [M] (w of each row), or 0 for "
      "all ones (an unweighted expert); experts: int64 [M] as in swiglu_forward; weights as in "
      "swiglu_forward. Writes out_dx = bf16([d_a, d_b] @ [Wg; Wu]) (bf16 [M, H], gate part first) "
      "and out_d_w = sum_i fl(g_i * h_i) (fp32 [M]), g = dy @ Wd; d_h = w * g, d_a = (d_h * b_c) * "
      "s * (1 + a_c * (1 - s)), d_b = d_h * silu(a_c), zero where the clamp bit, both rounded to "
      "bf16. Adds in place, each expert's rows in ascending order: acc_gate_up[e] += [d_a, d_b]^T "
      "x (fp32 [El, 2I, H], gate rows first) and acc_down[e] += bf16(w dy)^T h (fp32 [El, H, I]); "
      "carrying them across calls over consecutive row ranges gives the bits of one call. Padding "
      "rows get dx = 0, d_w = 0 and add nothing. Bitwise mok-torch's reference (row_backward, "
      "accumulate_wgrads). num_threads: CPU threads over rows, then over experts' accumulator "
      "rows (the bits do not depend on it). Devices and errors as in swiglu_forward.");

  m.def(
      "grouped_forward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t offsets, std::uintptr_t w_gate,
         std::uintptr_t w_up, std::uintptr_t w_down, std::uintptr_t out_a, std::uintptr_t out_b,
         std::uintptr_t out_h, std::uintptr_t out_y, std::int64_t num_rows, std::int64_t hidden,
         std::int64_t inner, std::int64_t num_experts, std::optional<double> limit,
         std::int64_t num_sms, std::int64_t num_threads, std::uintptr_t stream, bool zero_outside) {
        GroupedForwardArgs a;
        a.x = x;
        a.offsets = offsets;
        a.w_gate = w_gate;
        a.w_up = w_up;
        a.w_down = w_down;
        a.out_a = out_a;
        a.out_b = out_b;
        a.out_h = out_h;
        a.out_y = out_y;
        a.shape = {num_rows, hidden, inner, num_experts};
        a.limit = core::swiglu_limit("grouped_forward", limit);
        a.num_sms = num_sms;
        a.num_threads = num_threads;
        a.zero_outside = zero_outside;
        grouped_forward(device, a, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("offsets"), py::arg("w_gate"), py::arg("w_up"),
      py::arg("w_down"), py::arg("out_a"), py::arg("out_b"), py::arg("out_h"), py::arg("out_y"),
      py::arg("num_rows"), py::arg("hidden"), py::arg("inner"), py::arg("num_experts"),
      py::arg("limit") = py::none(), py::arg("num_sms") = 0, py::arg("num_threads") = 1,
      py::arg("stream") = 0, py::arg("zero_outside") = false,
      py::call_guard<py::gil_scoped_release>(),
      "SwiGLU expert forward over segments of consecutive rows (the schedule table's layout): "
      "rows [offsets[e], offsets[e+1]) of x (bf16 [M, H]) belong to local expert e; offsets: "
      "int64 [El + 1]. Writes out_a, out_b (bf16 [M, I]: x @ Wg^T, x @ Wu^T rounded to bf16), "
      "out_h (bf16 [M, I]: bf16(silu(a_c) * b_c), 0 allowed when out_y is 0) and, unless out_y "
      "is 0, out_y = bf16(h @ Wd^T) (bf16 [M, H]); rows outside every segment are not written "
      "(zero_outside=True: zeroed, on the device, so fresh outputs need no fill). "
      "'cuda': tensor-core GEMMs (sm_90a wgmma, fp32 accumulation in one fixed order: a row's "
      "bits do not depend on the other rows, the grid or num_sms), the offsets read on the "
      "device only (clamped to [0, M]); H and I multiples of 64, El <= 1024, 16-byte aligned "
      "arrays. 'cpu': the reference arithmetic (as swiglu_forward), offsets checked. num_sms: "
      "most CTAs per GEMM on cuda (0: every SM); num_threads: CPU threads. Raises ValueError "
      "naming a bad argument.");

  m.def(
      "grouped_backward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t offsets, std::uintptr_t a_,
         std::uintptr_t b_, std::uintptr_t dy, std::uintptr_t router_weights, std::uintptr_t w_gate,
         std::uintptr_t w_up, std::uintptr_t w_down, std::uintptr_t out_dx, std::uintptr_t out_d_w,
         std::uintptr_t acc_gate, std::uintptr_t acc_up, std::uintptr_t acc_down,
         std::uintptr_t out_gate, std::uintptr_t out_up, std::uintptr_t out_down, bool carry_in,
         std::uintptr_t scratch_g, std::uintptr_t scratch_hw, std::uintptr_t scratch_d_ab,
         std::int64_t num_rows, std::int64_t hidden, std::int64_t inner, std::int64_t num_experts,
         std::optional<double> limit, std::int64_t num_sms, std::int64_t num_threads,
         std::uintptr_t stream, bool zero_outside, std::uintptr_t weight_route,
         std::int64_t num_routes, std::uintptr_t dy_tokens, std::int64_t topk,
         std::uintptr_t out_d_w_routes, std::int64_t dwd_gather, std::uintptr_t x_tokens,
         std::int64_t dw1_mode) {
        GroupedBackwardArgs a;
        a.x = x;
        a.offsets = offsets;
        a.a = a_;
        a.b = b_;
        a.dy = dy;
        a.router_weights = router_weights;
        a.w_gate = w_gate;
        a.w_up = w_up;
        a.w_down = w_down;
        a.out_dx = out_dx;
        a.out_d_w = out_d_w;
        a.acc_gate = acc_gate;
        a.acc_up = acc_up;
        a.acc_down = acc_down;
        a.out_gate = out_gate;
        a.out_up = out_up;
        a.out_down = out_down;
        a.carry_in = carry_in;
        a.scratch_g = scratch_g;
        a.scratch_hw = scratch_hw;
        a.scratch_d_ab = scratch_d_ab;
        a.shape = {num_rows, hidden, inner, num_experts};
        a.limit = core::swiglu_limit("grouped_backward", limit);
        a.num_sms = num_sms;
        a.num_threads = num_threads;
        a.zero_outside = zero_outside;
        a.weight_route = weight_route;
        a.num_routes = num_routes;
        a.dy_tokens = dy_tokens;
        a.topk = topk;
        a.out_d_w_routes = out_d_w_routes;
        a.dwd_gather = dwd_gather;
        a.x_tokens = x_tokens;
        a.dw1_mode = dw1_mode;
        grouped_backward(device, a, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("offsets"), py::arg("a"), py::arg("b"),
      py::arg("dy"), py::arg("router_weights"), py::arg("w_gate"), py::arg("w_up"),
      py::arg("w_down"), py::arg("out_dx"), py::arg("out_d_w"), py::arg("acc_gate"),
      py::arg("acc_up"), py::arg("acc_down"), py::arg("out_gate"), py::arg("out_up"),
      py::arg("out_down"), py::arg("carry_in"), py::arg("scratch_g"), py::arg("scratch_hw"),
      py::arg("scratch_d_ab"), py::arg("num_rows"), py::arg("hidden"), py::arg("inner"),
      py::arg("num_experts"), py::arg("limit") = py::none(), py::arg("num_sms") = 0,
      py::arg("num_threads") = 1, py::arg("stream") = 0, py::arg("zero_outside") = false,
      py::arg("weight_route") = 0, py::arg("num_routes") = 0, py::arg("dy_tokens") = 0,
      py::arg("topk") = 1, py::arg("out_d_w_routes") = 0, py::arg("dwd_gather") = -1,
      py::arg("x_tokens") = 0, py::arg("dw1_mode") = 0, py::call_guard<py::gil_scoped_release>(),
      "SwiGLU expert backward over segments of consecutive rows (grouped_forward's layout). "
      "Writes out_dx (bf16 [M, H]: [d_a, d_b] @ [Wg; Wu]) and out_d_w (fp32 [M]: <g, h>, g = dy "
      "@ Wd unweighted) for the rows of the segments (other rows not written; zero_outside=True: "
      "zeroed, on the device); the weight gradients dWg, dWu ([El, I, H]) "
      "and dWd ([El, H, I]) are C + the segments' sums, C the fp32 accumulators acc_* when "
      "carry_in (else +0), written to acc_* (fp32) and/or out_* (bf16, rounded) where given; "
      "router_weights fp32 [M] or 0 (all ones). 'cuda': tensor-core GEMMs, dWd = C + dy^T "
      "bf16(w h); the weight gradients take each expert's rows in 64-row blocks from its segment "
      "start (calls split at multiples of 64 rows from the segment starts, the later ones with "
      "carry_in, give the bits of one call); scratch_hw bf16 [M, I] (bf16(w h)) and scratch_d_ab "
      "bf16 [M, 2I] are required and 16-byte aligned, scratch_g fp32 [M, I] (g = dy @ Wd) too "
      "where I > G_SWIGLU_MAX_INNER, and below it is written only where given; H and I "
      "multiples of 64, El <= "
      "1024. 'cpu': the reference arithmetic (swiglu_backward per segment), scratch unused "
      "(may be 0), offsets checked. weight_route (optional, 'cuda'): int32 [M], each row's route "
      "(-1: padding); given, router_weights is the routes' weights [num_routes] and row r's "
      "weight router_weights[weight_route[r]] (0 for a route outside [0, num_routes)): the bits "
      "of the call with the weights copied into table order. dy_tokens (optional, 'cuda', with "
      "weight_route): bf16 [num_routes / topk, H], the token rows; given, row r's dy is "
      "dy_tokens[weight_route[r] / topk] (zeros outside [0, num_routes)), gathered by the g "
      "GEMM (and by dWd where dwd_gather says so: -1 where I <= 256 and the device's memory "
      "bandwidth is below 4 TB/s, 0 never, 1 always; the same bits), and dy is not read: scratch, "
      "given those rows in table order where dWd reads a copy; it may be out_dx. "
      "out_d_w_routes (optional, 'cuda', with weight_route): fp32 [num_routes]; given, each row's "
      "d_w is also stored at its route (a route no row lists is not written), and out_d_w may be "
      "0 unless zero_outside. dw1_mode ('cuda'; the same bits in every mode): 0 dWg, dWu as "
      "[d_a, d_b]^T x; 1 as x^T [d_a, d_b] stored transposed; 2 as 1 with x's rows gathered from "
      "x_tokens (bf16 [num_routes / topk, H], with weight_route: row r's x is "
      "x_tokens[weight_route[r] / topk], zeros outside [0, num_routes)) and x not read. Raises "
      "ValueError naming a bad argument.");

  m.def(
      "moe_forward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t row_route,
         std::uintptr_t offsets, std::uintptr_t w_gate, std::uintptr_t w_up, std::uintptr_t w_down,
         std::uintptr_t out_a, std::uintptr_t out_b, std::uintptr_t scratch_h,
         std::uintptr_t out_rows, std::uintptr_t task_state, std::uintptr_t error,
         std::int64_t capacity, std::int64_t num_tokens, std::int64_t hidden, std::int64_t inner,
         std::int64_t num_experts, std::int64_t topk, std::optional<double> limit,
         std::int64_t num_sms, std::int64_t timeout_ns, std::int64_t stage, std::int64_t rank,
         bool inject_missing_dependency, std::uintptr_t stream, std::uintptr_t timers,
         std::uintptr_t out_x, std::int64_t world_size, std::uintptr_t row_src,
         std::uintptr_t x_ranks, std::uintptr_t out_rows_ranks, std::int64_t num_threads) {
        MoeForwardArgs a;
        a.x = x;
        a.row_route = row_route;
        a.offsets = offsets;
        a.w_gate = w_gate;
        a.w_up = w_up;
        a.w_down = w_down;
        a.out_a = out_a;
        a.out_b = out_b;
        a.scratch_h = scratch_h;
        a.out_rows = out_rows;
        a.task_state = task_state;
        a.error = error;
        a.shape = {capacity, hidden, inner, num_experts};
        a.num_tokens = num_tokens;
        a.topk = topk;
        a.limit = core::swiglu_limit("moe_forward", limit);
        a.num_sms = num_sms;
        a.timeout_ns = timeout_ns;
        a.stage = stage;
        a.rank = rank;
        a.inject_missing_dependency = inject_missing_dependency;
        a.timers = timers;
        a.out_x = out_x;
        a.world_size = world_size;
        a.row_src = row_src;
        a.x_ranks = x_ranks;
        a.out_rows_ranks = out_rows_ranks;
        a.num_threads = num_threads;
        moe_forward(device, a, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("row_route"), py::arg("offsets"), py::arg("w_gate"),
      py::arg("w_up"), py::arg("w_down"), py::arg("out_a"), py::arg("out_b"), py::arg("scratch_h"),
      py::arg("out_rows"), py::arg("task_state"), py::arg("error"), py::arg("capacity"),
      py::arg("num_tokens"), py::arg("hidden"), py::arg("inner"), py::arg("num_experts"),
      py::arg("topk"), py::arg("limit") = py::none(), py::arg("num_sms") = 0,
      py::arg("timeout_ns") = 300000000000LL, py::arg("stage") = 0, py::arg("rank") = 0,
      py::arg("inject_missing_dependency") = false, py::arg("stream") = 0, py::arg("timers") = 0,
      py::arg("out_x") = 0, py::arg("world_size") = 1, py::arg("row_src") = 0,
      py::arg("x_ranks") = 0, py::arg("out_rows_ranks") = 0, py::arg("num_threads") = 1,
      py::call_guard<py::gil_scoped_release>(),
      "The routed experts of a layer call in one call: on \"cuda\" one persistent launch "
      "(sm_90a; docs/megakernel.md), on \"cpu\" the same rows through the CPU kernels. For each "
      "row r of the schedule table's segments (offsets: int32 "
      "[El + 1]; row_route: int32 [C], route t*K + k or -1 for padding): x_r = x[route / K] (bf16 "
      "[T, H]), [a, b] = x_r @ [Wg_e; Wu_e]^T, h = bf16(silu(a_c) * b_c), y_r = h @ Wd_e^T stored "
      "at out_rows[route] (bf16 [T*K, H]). Writes out_a, out_b (bf16 [C, I], zero past the last "
      "segment; both 0: not written, a forward no backward follows); scratch_h bf16 [C, I]; out_x "
      "(0: none) bf16 [C, H], x_r of every table row (zeros for padding rows and past the last "
      "segment). The bits of grouped_forward. With world_size > 1 row r's x is row route / K of "
      "rank row_src[r] (int32 [C]) at x_ranks (int64 [R] addresses, each 16-byte aligned; on "
      "\"cuda\" device memory, a peer's mapped segment or this device's) and y_r goes to row "
      "route of that rank's rows at out_rows_ranks; x and out_rows are not read (timers must be "
      "0). task_state: "
      "moe_forward_state_bytes(C, El) bytes, zero before the first call (every call leaves it "
      "zero); error: int32 [4], the transport's error words (a task that waits more than "
      "timeout_ns records a timeout with `stage` and `rank`). H and I multiples of 64, El <= "
      "1024. Raises ValueError naming a bad argument.");
  m.def(
      "moe_backward",
      [](const std::string& device, std::uintptr_t x, std::uintptr_t a, std::uintptr_t b,
         std::uintptr_t row_route, std::uintptr_t offsets, std::uintptr_t w_gate,
         std::uintptr_t w_up, std::uintptr_t w_down, std::uintptr_t dy,
         std::uintptr_t router_weights, std::uintptr_t out_dx_rows, std::uintptr_t out_d_router,
         std::uintptr_t acc_gate, std::uintptr_t acc_up, std::uintptr_t acc_down,
         std::uintptr_t out_gate, std::uintptr_t out_up, std::uintptr_t out_down, bool carry_in,
         std::int64_t capacity, std::int64_t num_tokens, std::int64_t hidden, std::int64_t inner,
         std::int64_t num_experts, std::int64_t topk, std::optional<double> limit,
         std::int64_t world_size, std::uintptr_t row_src, std::uintptr_t dy_ranks,
         std::uintptr_t weights_ranks, std::uintptr_t out_dx_rows_ranks,
         std::uintptr_t out_d_router_ranks, std::int64_t num_threads, std::uintptr_t stream) {
        MoeBackwardArgs m;
        m.x = x;
        m.a = a;
        m.b = b;
        m.row_route = row_route;
        m.offsets = offsets;
        m.w_gate = w_gate;
        m.w_up = w_up;
        m.w_down = w_down;
        m.dy = dy;
        m.router_weights = router_weights;
        m.out_dx_rows = out_dx_rows;
        m.out_d_router = out_d_router;
        m.acc_gate = acc_gate;
        m.acc_up = acc_up;
        m.acc_down = acc_down;
        m.out_gate = out_gate;
        m.out_up = out_up;
        m.out_down = out_down;
        m.carry_in = carry_in;
        m.shape = {capacity, hidden, inner, num_experts};
        m.num_tokens = num_tokens;
        m.topk = topk;
        m.limit = core::swiglu_limit("moe_backward", limit);
        m.world_size = world_size;
        m.row_src = row_src;
        m.dy_ranks = dy_ranks;
        m.weights_ranks = weights_ranks;
        m.out_dx_rows_ranks = out_dx_rows_ranks;
        m.out_d_router_ranks = out_d_router_ranks;
        m.num_threads = num_threads;
        moe_backward(device, m, stream);
      },
      py::arg("device"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("row_route"),
      py::arg("offsets"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down"), py::arg("dy"),
      py::arg("router_weights"), py::arg("out_dx_rows"), py::arg("out_d_router"),
      py::arg("acc_gate"), py::arg("acc_up"), py::arg("acc_down"), py::arg("out_gate"),
      py::arg("out_up"), py::arg("out_down"), py::arg("carry_in"), py::arg("capacity"),
      py::arg("num_tokens"), py::arg("hidden"), py::arg("inner"), py::arg("num_experts"),
      py::arg("topk"), py::arg("limit") = py::none(), py::arg("world_size") = 1,
      py::arg("row_src") = 0, py::arg("dy_ranks") = 0, py::arg("weights_ranks") = 0,
      py::arg("out_dx_rows_ranks") = 0, py::arg("out_d_router_ranks") = 0,
      py::arg("num_threads") = 1, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "The routed experts' backward of a layer call in one call, the mirror of moe_forward, on "
      "\"cpu\" (on \"cuda\" one rank's backward is moe_backward_call). For each row r of the "
      "schedule table's segments (offsets: int32 [El + 1]; row_route: int32 [C], route t*K + k or "
      "-1 for padding): dy_r = dy[route / K] (bf16 [T, H]), w_r = router_weights[route] (fp32 "
      "[T*K]; 0: ones), the grouped backward on the table's rows (x, a, b: the forward's context, "
      "bf16 [C, H], [C, I], [C, I]), dx_r stored at out_dx_rows[route] (bf16 [T*K, H]) and d_w_r "
      "at out_d_router[route] (fp32 [T*K]; 0: not stored); the weight gradients as "
      "grouped_backward's (acc_*: fp32 accumulators, carried in with carry_in; out_*: bf16). The "
      "bits of grouped_backward on the same rows in table order. With world_size > 1 row r's "
      "source is rank row_src[r] (int32 [C]): its dy, weights, dx rows and d_router are that "
      "rank's, at the addresses in dy_ranks, weights_ranks, out_dx_rows_ranks and "
      "out_d_router_ranks (int64 [R] each; the last 0: not stored), and dy, router_weights, "
      "out_dx_rows, out_d_router are not read; a route outside [0, T*K) or a source outside [0, "
      "R) is a padding row. Raises ValueError naming a bad argument.");
  m.def(
      "moe_forward_call",
      [](const py::capsule& entry_points, const std::string& device, std::uintptr_t routes,
         bool routes_int64, std::int64_t num_tokens, std::int64_t max_tokens, std::int64_t topk,
         std::int64_t alignment, std::int64_t capacity, std::uintptr_t row_src_rank,
         std::uintptr_t row_route, std::uintptr_t expert_offsets, std::uintptr_t expert_counts,
         std::uintptr_t recv_counts, std::uintptr_t tokens_per_rank, std::uintptr_t route_row,
         std::uintptr_t routes_copy, std::uintptr_t table_scratch, std::uintptr_t x,
         std::uintptr_t w_gate, std::uintptr_t w_up, std::uintptr_t w_down, std::uintptr_t out_a,
         std::uintptr_t out_b, std::uintptr_t out_x, std::uintptr_t scratch_h, std::uintptr_t rows,
         std::uintptr_t task_state, std::uintptr_t error, std::int64_t hidden, std::int64_t inner,
         std::int64_t num_experts, std::optional<double> limit, std::int64_t timeout_ns,
         std::int64_t stage, std::int64_t num_threads, std::uintptr_t out, std::uintptr_t weights,
         std::uintptr_t error_mirror, std::uintptr_t stream) {
        const core::EntryPoints& entries = entries_of(entry_points, "moe_forward_call");
        MoeForwardCallArgs a;
        core::TableArgs& t = a.table;
        t.world_size = 1;
        t.max_tokens = max_tokens;
        t.topk = topk;
        t.num_local_experts = num_experts;
        t.alignment = alignment;
        t.capacity = capacity;
        t.row_src_rank = row_src_rank;
        t.row_route = row_route;
        t.expert_offsets = expert_offsets;
        t.expert_counts = expert_counts;
        t.recv_counts = recv_counts;
        t.tokens_per_rank = tokens_per_rank;
        t.scratch = table_scratch;
        t.error = error;
        t.local_routes = true;
        t.routes = routes;
        t.routes_int64 = routes_int64;
        t.num_tokens = num_tokens;
        t.route_row = route_row;
        t.routes_copy = routes_copy;
        MoeForwardArgs& e = a.experts;
        e.x = x;
        e.row_route = row_route;
        e.offsets = expert_offsets;
        e.w_gate = w_gate;
        e.w_up = w_up;
        e.w_down = w_down;
        e.out_a = out_a;
        e.out_b = out_b;
        e.out_x = out_x;
        e.scratch_h = scratch_h;
        e.out_rows = rows;
        e.task_state = task_state;
        e.error = error;
        e.shape = {capacity, hidden, inner, num_experts};
        e.num_tokens = num_tokens;
        e.topk = topk;
        e.limit = core::swiglu_limit("moe_forward_call", limit);
        e.timeout_ns = timeout_ns;
        e.stage = stage;
        e.num_threads = num_threads;
        core::CombineArgs& c = a.combine;
        c.out = out;
        c.rows = rows;
        c.weights = weights;
        c.num_tokens = num_tokens;
        c.topk = topk;
        c.hidden = hidden;
        c.error = error_mirror != 0 ? error : 0;
        c.error_mirror = error_mirror;
        py::gil_scoped_release release;
        moe_forward_call(entries, device, a, stream);
      },
      "One rank's forward in one call (docs/megakernel.md, \"The host\"), all arguments "
      "positional: entry_points (mok_core.entry_points()), device, then the schedule table as "
      "mok_core.build_table takes it with local_routes (routes, routes_int64, num_tokens, "
      "max_tokens, topk, alignment, capacity, row_src_rank, row_route, expert_offsets, "
      "expert_counts, recv_counts, tokens_per_rank, route_row, routes_copy, and its scratch), then "
      "moe_forward on that table (x, w_gate, w_up, w_down, out_a, out_b, out_x, scratch_h, rows: "
      "its out_rows, task_state, error, hidden, inner, num_experts, limit, timeout_ns, stage, "
      "num_threads), then mok_core.combine of `rows` into out (bf16 [num_tokens, hidden]) with "
      "weights (fp32 [num_tokens * topk]), publishing the error words to error_mirror (an "
      "ErrorMirror's device_address, or 0: none), and the stream. The bits of the three calls; on "
      "\"cpu\" out_a, out_b and out_x must be 0. Raises ValueError naming a bad argument.");
  m.def(
      "moe_backward_call",
      [](const py::capsule& entry_points, const std::string& device, std::uintptr_t offsets32,
         std::uintptr_t offsets, std::uintptr_t x, std::uintptr_t a_, std::uintptr_t b_,
         std::uintptr_t dy, std::uintptr_t router_weights, std::uintptr_t weight_route,
         std::uintptr_t dy_tokens, std::uintptr_t x_tokens, std::int64_t num_tokens,
         std::int64_t topk, std::uintptr_t w_gate, std::uintptr_t w_up, std::uintptr_t w_down,
         std::uintptr_t out_d_router, std::uintptr_t acc_gate, std::uintptr_t acc_up,
         std::uintptr_t acc_down, std::uintptr_t out_gate, std::uintptr_t out_up,
         std::uintptr_t out_down, std::uintptr_t scratch_g, std::uintptr_t scratch_hw,
         std::uintptr_t scratch_d_ab, std::int64_t num_rows, std::int64_t hidden,
         std::int64_t inner, std::int64_t num_experts, std::optional<double> limit,
         std::uintptr_t out, std::uintptr_t base, std::uintptr_t route_row, std::uintptr_t error,
         std::uintptr_t error_mirror, std::uintptr_t stream) {
        const core::EntryPoints& entries = entries_of(entry_points, "moe_backward_call");
        MoeBackwardCallArgs c;
        c.offsets32 = offsets32;
        GroupedBackwardArgs& e = c.experts;
        e.x = x;
        e.offsets = offsets;
        e.a = a_;
        e.b = b_;
        e.dy = dy;
        e.router_weights = router_weights;
        e.w_gate = w_gate;
        e.w_up = w_up;
        e.w_down = w_down;
        e.out_dx = dy;
        e.out_d_w_routes = out_d_router;
        e.acc_gate = acc_gate;
        e.acc_up = acc_up;
        e.acc_down = acc_down;
        e.out_gate = out_gate;
        e.out_up = out_up;
        e.out_down = out_down;
        e.carry_in = false;
        e.scratch_g = scratch_g;
        e.scratch_hw = scratch_hw;
        e.scratch_d_ab = scratch_d_ab;
        e.shape = {num_rows, hidden, inner, num_experts};
        e.limit = core::swiglu_limit("moe_backward_call", limit);
        e.weight_route = weight_route;
        e.num_routes = num_tokens * topk;
        e.dy_tokens = dy_tokens;
        e.x_tokens = x_tokens;
        e.dw1_mode = x_tokens != 0 ? 2 : 0;
        e.topk = topk;
        core::CombineArgs& m_ = c.combine;
        m_.out = out;
        m_.base = base;
        m_.rows = dy;
        m_.num_tokens = num_tokens;
        m_.topk = topk;
        m_.hidden = hidden;
        m_.row_index = route_row;
        m_.num_rows = num_rows;
        m_.error = error;
        m_.error_mirror = error_mirror;
        py::gil_scoped_release release;
        moe_backward_call(entries, device, c, stream);
      },
      "One rank's direct backward in one call (docs/megakernel.md, \"The host\"), \"cuda\" only, "
      "all arguments positional: entry_points (mok_core.entry_points()), device, offsets32 (the "
      "table's int32 [El + 1]) and offsets (int64 [El + 1], written: offsets32 widened), then "
      "grouped_backward's arrays over the table's rows (x, a, b; dy: bf16 [num_rows, hidden], "
      "written: dx's rows, after serving as scratch; dy itself is read by route), router_weights "
      "(fp32 "
      "[num_tokens * topk]) and dy_tokens (bf16 [num_tokens, hidden]) read by each row's route "
      "(weight_route: the table's row_route), x_tokens (bf16 [num_tokens, hidden], the forward's "
      "token rows, or 0: given, dW1 gathers x's rows from them by route, dw1_mode 2, and x may be "
      "0), num_tokens, topk, the weights, out_d_router (fp32 "
      "[num_tokens * topk], written: each route's d_w, 0 for a route no row lists), the weight "
      "gradients (acc_* fp32 and/or out_* bf16, nothing carried in), the scratch (scratch_g, 0 "
      "where I <= G_SWIGLU_MAX_INNER, scratch_hw, scratch_d_ab), num_rows, hidden, inner, "
      "num_experts, limit, then "
      "mok_core.combine of the dx rows into out (bf16 [num_tokens, hidden]) over base (bf16 or 0) "
      "through route_row (int32 [num_tokens * topk], each route's row), publishing the error words "
      "(error: int32 [4], or 0) to error_mirror (an ErrorMirror's device_address, or 0), and the "
      "stream. The bits "
      "of grouped_backward then mok_core.combine (d_router: grouped_backward's d_w gathered by "
      "route). Raises ValueError naming a bad argument.");
  m.def("moe_forward_state_bytes", &moe_forward_state_bytes, py::arg("capacity"),
        py::arg("num_experts"),
        "Bytes of moe_forward's task state (ticket queue and per-row-tile counters).");
}

}  // namespace mok::bf16::bindings
