// The grouped SwiGLU backward on the GPU, over the experts' segments of consecutive rows (dy and
// the router weights the table's rows, or read through each row's route: dy_tokens, weight_route):
//
//   g + SwiGLU, I <= 256 (one column tile a row): g = dy @ Wd_e and, in the same kernel's
//            epilogue, hw = bf16(w h), d_a, d_b, d_w = <g, h> per row (g_swiglu.cuh: 64-row
//            units, two consumer warpgroups in ping-pong, one's epilogue under the other's
//            mainloop, clusters of two sharing Wd; g stored only where asked for)
//   g, I > 256: g = dy @ Wd_e               (grouped GEMM, Wd N-major; fp32 out, unrounded)
//   SwiGLU, I > 256: hw, d_a, d_b, d_w per row from g (an elementwise kernel)
//            Either way mok-core's element math, the reference's bit for bit given a, b, g and
//            w, and d_w summed in one fixed order that depends only on I. With dy_tokens the g
//            GEMM's producers gather dy's rows (grouped_gemm.cuh's RowGather); unless dWd gathers
//            them too, its units (tiles) of column 0 store them into dy in table order for dWd.
//   dWd:     dWd = C + dy^T bf16(w h)       (wgrad_gemm.cuh: rows as the reduction, fp32 carried
//            across calls, bf16 out; with dy_tokens, I <= 256 and dwd_gather (by default on
//            memory below 4 TB/s) dy's rows gathered again by its producers; before dx, so that
//            dx's rows may overwrite dy's)
//   dx:      dx = [d_a, d_b] @ [Wg_e; Wu_e]  (grouped GEMM over K = 2I, gate part first)
//   dWg/dWu: dWg, dWu = C + [d_a, d_b]^T x  (one weight-gradient GEMM)
//
// The router weight sits on h's side of dWd (the reference's is bf16(w dy)^T h): the SwiGLU
// kernel writes bf16(w h) where it would write h, so dy is read as it came and no weighted copy
// of it is made (NOTES.md, session 16). The fused g kernel is the faster where a row has one
// column tile (sonic-7b on an H100: 570 against 350 + 264 us); with three (qwen3-30b-a3b) its
// epilogues run in unit order for d_w's hand-over and the two kernels are faster (NOTES.md,
// sessions 47-50).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "g_swiglu.cuh"
#include "grouped_gemm.cuh"
#include "launch.cuh"
#include "mok/bf16/experts.h"
#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"
#include "mok/core/hopper.cuh"
#include "mok/core/sigmoid_table.cuh"
#include "wgrad_gemm.cuh"

namespace mok::bf16 {
namespace {

using gemm::BLoad;
using kernels::check;

// One warp per row of the segments (tiles::for_each_row_range); lane l takes the 8-element
// pieces l, l + 32, ... of the row. d_w: each lane sums fl(g_i * h_i) over its elements in
// ascending order from +0, then the lanes' sums are added by a butterfly (xor 16, 8, 4, 2, 1):
// an order fixed by I alone, the same on every lane.
struct SwigluBackwardRows {
  const std::uint16_t* a;
  const std::uint16_t* b;
  const float* g;                    // [M, I]
  const float* router_weights;       // [M] (weight_route: [num_routes]) or null: all ones
  const std::int32_t* weight_route;  // [M] or null: row r's weight is router_weights[route]
  int num_routes;                    // routes outside [0, num_routes) weigh 0 (padding)
  std::uint16_t* hw;                 // [M, I]: bf16(w h) (h itself for unweighted rows)
  std::uint16_t* d_ab;               // [M, 2I]
  float* d_w;                        // [M] or null
  float* d_w_routes;                 // [num_routes] or null (with weight_route): d_w by route
  const std::int64_t* offsets;
  int num_experts;
  std::int64_t num_rows;
  int inner;
  core::SwigluLimit limit;
};

// Rows [lo, hi) of the kernel below, the clamp `lim` (r.limit, or the constant SwigluLimit{}
// where it is off: core::with_swiglu_limit).
__device__ inline void swiglu_backward_rows(const SwigluBackwardRows& r, std::int64_t lo,
                                            std::int64_t hi, core::SwigluLimit lim) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const int I = r.inner;
  const auto sig = core::TableSigmoid::of(lim);  // sigmoid_table.cuh: the reference's bits
  for (std::int64_t row =
           lo + (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
       row < hi; row += warps) {
    float w = 1.0f;
    const int route = r.weight_route != nullptr ? r.weight_route[row] : -1;
    const bool routed = route >= 0 && route < r.num_routes;
    if (r.router_weights != nullptr && r.weight_route == nullptr) {
      w = r.router_weights[row];
    } else if (r.router_weights != nullptr) {
      w = routed ? r.router_weights[route] : 0.0f;
    }
    float part = 0.0f;
    for (int i = 8 * lane; i < I; i += 8 * 32) {
      const std::int64_t at = row * I + i;
      const uint4 av = *reinterpret_cast<const uint4*>(r.a + at);
      const uint4 bv = *reinterpret_cast<const uint4*>(r.b + at);
      const float4 g0 = *reinterpret_cast<const float4*>(r.g + at);
      const float4 g1 = *reinterpret_cast<const float4*>(r.g + at + 4);
      const float gs[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      uint4 hw, daw, dbw;
      part = core::swiglu_backward8(gs, w, av, bv, lim, sig, part, hw, daw, dbw);
      *reinterpret_cast<uint4*>(r.hw + at) = hw;
      *reinterpret_cast<uint4*>(r.d_ab + row * 2 * I + i) = daw;
      *reinterpret_cast<uint4*>(r.d_ab + row * 2 * I + I + i) = dbw;
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2)
      part = core::add_rn(part, __shfl_xor_sync(0xFFFFFFFFu, part, d));
    if (lane == 0 && r.d_w != nullptr) r.d_w[row] = part;
    if (lane == 0 && r.d_w_routes != nullptr && routed) r.d_w_routes[route] = part;
  }
}

// The fused g kernel's ring: 4 stages of 40 KiB (64 rows of dy, 256 columns of Wd), beside the
// sigmoid's entries and the epilogues' a and b in shared memory.
constexpr int kGStages = 4;

// moe_backward_call's preparation (one launch): the table's offsets widened to int64, and the
// route-ordered d_w zeroed (a route no row lists keeps 0).
__global__ void moe_backward_prepare_kernel(const std::int32_t* offsets32, std::int64_t* offsets64,
                                            int num_experts, float* d_w_routes,
                                            std::int64_t num_routes) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < num_routes || i <= num_experts; i += stride) {
    if (i <= num_experts) offsets64[i] = offsets32[i];
    if (i < num_routes) d_w_routes[i] = 0.0f;
  }
}

__global__ void swiglu_backward_kernel(SwigluBackwardRows r) {
  __shared__ int sorted;
  tiles::for_each_row_range(
      r.offsets, r.num_experts, r.num_rows, &sorted, [&](std::int64_t lo, std::int64_t hi) {
        core::with_swiglu_limit(
            r.limit, [&](core::SwigluLimit lim) { swiglu_backward_rows(r, lo, hi, lim); });
      });
}

// The most clusters of two CTAs of `kKernel` that can be resident at once on this device (0 if
// none: the device takes no clusters).
template <auto kKernel>
int resident_pairs(int shared_bytes) {
  static std::atomic<int> known[kernels::kTrackedDevices];
  const int device = kernels::current_device();
  const bool tracked = device >= 0 && device < kernels::kTrackedDevices;
  if (tracked) {
    if (const int n = known[device].load(std::memory_order_relaxed); n != 0) return n < 0 ? 0 : n;
  }
  const kernels::PairLaunch pair(2, gemm::kThreads, static_cast<std::size_t>(shared_bytes),
                                 nullptr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kKernel, &pair.config) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of the call: no clusters, the kernel without them
    n = 0;
  }
  if (tracked) known[device].store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n;
}

// The g GEMM with the SwiGLU backward in its epilogue (g_swiglu.cuh) on at most num_sms CTAs (no
// more than its 64-row blocks); kGatherA: dy's rows through `gather` (map_a: its copy's map);
// kStoreG: g stored too (swiglu.g). In clusters of two CTAs sharing B (each a block of every tile
// the pair takes) where two SMs or more are asked for and a cluster fits; else one CTA a tile.
template <bool kGatherA, bool kStoreG>
void launch_g_swiglu(const CUtensorMap& map_a, const CUtensorMap& map_b, const gemm::Problem& p,
                     const gemm::GSwiglu& swiglu, const gemm::RowGather& gather, int num_sms,
                     cudaStream_t stream) {
  constexpr int kShared = gemm::g_swiglu_shared_bytes<kGStages>;
  constexpr auto single = gemm::g_swiglu_gemm_kernel<kGStages, kGatherA, kStoreG, 1>;
  constexpr auto paired = gemm::g_swiglu_gemm_kernel<kGStages, kGatherA, kStoreG, 2>;
  // Every expert adds at most one partial row tile.
  const std::int64_t most = (p.num_rows + gemm::kBlockM - 1) / gemm::kBlockM + p.num_experts;
  if (num_sms >= 2) {
    kernels::allow_shared_bytes<paired>(kShared);
    const int pairs = std::min(num_sms / 2, resident_pairs<paired>(kShared));
    if (pairs >= 1) {
      const kernels::PairLaunch pair(static_cast<unsigned>(2 * std::min<std::int64_t>(pairs, most)),
                                     gemm::kThreads, kShared, stream);
      check(cudaLaunchKernelEx(&pair.config, paired, map_a, map_b, p, swiglu, gather),
            "launching the g GEMM with the SwiGLU backward");
      return;
    }
  }
  kernels::allow_shared_bytes<single>(kShared);
  const int grid =
      static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_sms, most)));
  single<<<grid, gemm::kThreads, kShared, stream>>>(map_a, map_b, p, swiglu, gather);
  check(cudaGetLastError(), "launching the g GEMM with the SwiGLU backward");
}

// One of the weight-gradient kernels on at most num_sms CTAs (no more than its tile groups), in
// clusters of kCluster; kGatherA: A's rows through p.gather; kTransposeC: C stored transposed
// (wgrad_gemm.cuh).
template <bool kCarryIn, bool kF32, int kCluster, bool kGatherA, bool kTransposeC>
void launch_wgrad_kernel(const CUtensorMap& map_a, const CUtensorMap& map_b,
                         const gemm::WgradProblem& p, int num_sms, cudaStream_t stream) {
  using R = gemm::Ring<kernels::kStages>;
  constexpr auto kernel =
      gemm::wgrad_gemm_kernel<kernels::kStages, kCarryIn, kF32, kCluster, kGatherA, kTransposeC>;
  kernels::allow_shared_bytes<kernel>(R::kSharedBytes);
  const std::int64_t m_groups =
      ((p.m + gemm::kBlockM - 1) / gemm::kBlockM + kCluster - 1) / kCluster;
  const std::int64_t groups =
      static_cast<std::int64_t>(p.num_experts) * m_groups * ((p.n + gemm::kMmaN - 1) / gemm::kMmaN);
  if constexpr (kCluster > 1) {
    const int pairs = std::min(num_sms / 2, resident_pairs<kernel>(R::kSharedBytes));
    if (pairs < 1) {  // no cluster fits: one CTA a tile group of one
      launch_wgrad_kernel<kCarryIn, kF32, 1, kGatherA, kTransposeC>(map_a, map_b, p, num_sms,
                                                                    stream);
      return;
    }
    const kernels::PairLaunch pair(static_cast<unsigned>(2 * std::min<std::int64_t>(pairs, groups)),
                                   gemm::kThreads, R::kSharedBytes, stream);
    check(cudaLaunchKernelEx(&pair.config, kernel, map_a, map_b, p),
          "launching a weight-gradient GEMM");
  } else {
    const int grid =
        static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(num_sms, groups)));
    kernel<<<grid, gemm::kThreads, R::kSharedBytes, stream>>>(map_a, map_b, p);
    check(cudaGetLastError(), "launching a weight-gradient GEMM");
  }
}

template <bool kGatherA, bool kTransposeC>
void launch_wgrad_as(const CUtensorMap& map_a, const CUtensorMap& map_b,
                     const gemm::WgradProblem& p, bool carry_in, int num_sms, cudaStream_t stream) {
  // bf16 outputs only (no fp32 accumulator, so nothing carried in): the deferred epilogue. In
  // clusters of two CTAs sharing B (wgrad_gemm.cuh) where two SMs or more are asked for.
  const bool f32 = p.part[0].f32 != nullptr || p.part[1].f32 != nullptr;
  constexpr bool kG = kGatherA, kT = kTransposeC;
  if (num_sms < 2) {
    if (carry_in) {
      return launch_wgrad_kernel<true, true, 1, kG, kT>(map_a, map_b, p, num_sms, stream);
    }
    if (f32) return launch_wgrad_kernel<false, true, 1, kG, kT>(map_a, map_b, p, num_sms, stream);
    return launch_wgrad_kernel<false, false, 1, kG, kT>(map_a, map_b, p, num_sms, stream);
  }
  if (carry_in) {
    return launch_wgrad_kernel<true, true, 2, kG, kT>(map_a, map_b, p, num_sms, stream);
  }
  if (f32) return launch_wgrad_kernel<false, true, 2, kG, kT>(map_a, map_b, p, num_sms, stream);
  launch_wgrad_kernel<false, false, 2, kG, kT>(map_a, map_b, p, num_sms, stream);
}

// The weight-gradient GEMM `p` (A gathered through p.gather where it is given; C stored
// transposed where `transpose_c`).
void launch_wgrad(const CUtensorMap& map_a, const CUtensorMap& map_b, const gemm::WgradProblem& p,
                  bool carry_in, int num_sms, cudaStream_t stream, bool transpose_c = false) {
  const bool gather = p.gather.rows != nullptr;
  if (transpose_c) {
    if (gather) return launch_wgrad_as<true, true>(map_a, map_b, p, carry_in, num_sms, stream);
    return launch_wgrad_as<false, true>(map_a, map_b, p, carry_in, num_sms, stream);
  }
  if (gather) return launch_wgrad_as<true, false>(map_a, map_b, p, carry_in, num_sms, stream);
  launch_wgrad_as<false, false>(map_a, map_b, p, carry_in, num_sms, stream);
}

}  // namespace

void moe_backward_prepare_cuda(std::uintptr_t offsets32, std::uintptr_t offsets64,
                               std::int64_t num_experts, std::uintptr_t d_w_routes,
                               std::int64_t num_routes, std::uintptr_t stream) {
  const std::int64_t n = std::max<std::int64_t>(num_routes, num_experts + 1);
  const int grid =
      static_cast<int>(std::min<std::int64_t>((n + 255) / 256, 4 * kernels::device_sms()));
  moe_backward_prepare_kernel<<<grid, 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const std::int32_t*>(offsets32), reinterpret_cast<std::int64_t*>(offsets64),
      static_cast<int>(num_experts), reinterpret_cast<float*>(d_w_routes), num_routes);
  check(cudaGetLastError(), "launching the backward's preparation kernel");
}

void grouped_backward_cuda(const GroupedBackwardArgs& args, std::uintptr_t stream_handle) {
  const ExpertShape& s = args.shape;
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int sms = args.num_sms > 0 ? static_cast<int>(args.num_sms) : kernels::device_sms();
  const std::uint64_t M = static_cast<std::uint64_t>(s.num_rows);
  const std::uint64_t H = static_cast<std::uint64_t>(s.hidden);
  const std::uint64_t I = static_cast<std::uint64_t>(s.inner);
  const std::uint64_t El = static_cast<std::uint64_t>(s.num_experts);
  const auto* offsets = reinterpret_cast<const std::int64_t*>(args.offsets);
  const auto ptr = [](std::uintptr_t p) { return reinterpret_cast<const void*>(p); };
  const int Ei = static_cast<int>(El), Hi = static_cast<int>(H), Ii = static_cast<int>(I);

  if (args.zero_outside) {
    kernels::zero_uncovered_rows({{args.out_dx, 2 * s.hidden}, {args.out_d_w, 4}}, offsets, Ei,
                                 s.num_rows, sms, stream);
  }
  // g = dy @ Wd_e: Wd [El, H, I] is N-major for this GEMM (K = H rows per expert).
  const CUtensorMap map_wd = hopper::make_tensor_map(ptr(args.w_down), El * H, I, 64);
  const gemm::Problem pg{offsets, s.num_rows, Ei, Ii, Hi, Hi};
  const bool store_g = args.scratch_g != 0;
  const bool gathered = args.dy_tokens != 0;
  // With dy_tokens dy's rows are gathered through each row's route by the g GEMM's producers (no
  // pass moves them). dWd gathers them again (args.dwd_gather) where C has one column tile (I <=
  // kMmaN: each row read once, as the copy is; with more, each column tile would gather the rows
  // anew) and, by default, where memory is slower than 4 TB/s; otherwise the g GEMM's tiles of
  // column 0 store them into dy in table order for dWd. NOTES.md, session 42: at I = 256 gathering
  // saved ~150 us of ~4 ms on an H100 (3.35 TB/s: the copy's stores cost ~270 us there) and lost
  // ~40 us on an H200 (4.8 TB/s: ~100 us); at I = 768 it lost ~175 us on an H100. Session 43's
  // raw routes cut the gather's cost in dWd from ~+80 to ~+25 us on an H100 (a backward ~250 us
  // faster at sonic-7b); the H200 and I = 768 are not measured since.
  const bool dwd_gathers =
      gathered && (args.dwd_gather == 1 || (args.dwd_gather == -1 && Ii <= gemm::kMmaN &&
                                            kernels::device_memory_bandwidth() > 0 &&
                                            kernels::device_memory_bandwidth() < 4e12));
  const CUtensorMap map_dy = hopper::make_tensor_map(ptr(args.dy), M, H, 64);
  const gemm::RowGather dy_rows{reinterpret_cast<const std::uint16_t*>(args.dy_tokens),
                                reinterpret_cast<const std::int32_t*>(args.weight_route),
                                s.num_rows,
                                static_cast<int>(args.num_routes),
                                static_cast<int>(args.topk),
                                Hi,
                                dwd_gathers ? nullptr : reinterpret_cast<std::uint16_t*>(args.dy)};
  core::ensure_sigmoid_table(stream);
  if (Ii <= kGSwigluMaxInner) {
    // One kernel: the SwiGLU backward in the g GEMM's epilogue (g_swiglu.cuh).
    const gemm::GSwiglu swiglu{reinterpret_cast<const std::uint16_t*>(args.a),
                               reinterpret_cast<const std::uint16_t*>(args.b),
                               reinterpret_cast<const float*>(args.router_weights),
                               reinterpret_cast<const std::int32_t*>(args.weight_route),
                               static_cast<int>(args.num_routes),
                               reinterpret_cast<std::uint16_t*>(args.scratch_hw),
                               reinterpret_cast<std::uint16_t*>(args.scratch_d_ab),
                               reinterpret_cast<float*>(args.out_d_w),
                               reinterpret_cast<float*>(args.out_d_w_routes),
                               reinterpret_cast<float*>(args.scratch_g),
                               Ii,
                               args.limit};
    if (gathered && store_g) {
      launch_g_swiglu<true, true>(map_dy, map_wd, pg, swiglu, dy_rows, sms, stream);
    } else if (gathered) {
      launch_g_swiglu<true, false>(map_dy, map_wd, pg, swiglu, dy_rows, sms, stream);
    } else if (store_g) {
      launch_g_swiglu<false, true>(map_dy, map_wd, pg, swiglu, {}, sms, stream);
    } else {
      launch_g_swiglu<false, false>(map_dy, map_wd, pg, swiglu, {}, sms, stream);
    }
  } else {
    // Two kernels: g stored (scratch_g, required here: experts.cpp), then the SwiGLU backward.
    const kernels::StoreF32 store{reinterpret_cast<float*>(args.scratch_g), Ii};
    if (gathered) {
      kernels::launch<BLoad::kNMajor, true>(map_dy, map_wd, map_wd, pg, store, sms, stream,
                                            dy_rows);
    } else {
      const CUtensorMap map_dy_tiles = hopper::make_tensor_map(ptr(args.dy), M, H, gemm::kBlockM);
      kernels::launch<BLoad::kNMajor>(map_dy_tiles, map_wd, map_wd, pg, store, sms, stream);
    }
    const SwigluBackwardRows rows{reinterpret_cast<const std::uint16_t*>(args.a),
                                  reinterpret_cast<const std::uint16_t*>(args.b),
                                  reinterpret_cast<const float*>(args.scratch_g),
                                  reinterpret_cast<const float*>(args.router_weights),
                                  reinterpret_cast<const std::int32_t*>(args.weight_route),
                                  static_cast<int>(args.num_routes),
                                  reinterpret_cast<std::uint16_t*>(args.scratch_hw),
                                  reinterpret_cast<std::uint16_t*>(args.scratch_d_ab),
                                  reinterpret_cast<float*>(args.out_d_w),
                                  reinterpret_cast<float*>(args.out_d_w_routes),
                                  offsets,
                                  Ei,
                                  s.num_rows,
                                  Ii,
                                  args.limit};
    // Every warp slot of the SMs, to hide the loads' latency.
    swiglu_backward_kernel<<<8 * sms, 256, 0, stream>>>(rows);
    check(cudaGetLastError(), "launching the SwiGLU backward kernel");
  }

  // Weight gradients, rows as the reduction: both operands staged MN-major (64-row boxes);
  // dWd first: it is the last reader of dy, so dx's GEMM may write its rows into dy's array
  // (GroupedBackwardArgs::out_dx == dy: one [M, H] array less at the backward's peak).
  const auto f32 = [](std::uintptr_t p) { return reinterpret_cast<float*>(p); };
  const auto bf16 = [](std::uintptr_t p) { return reinterpret_cast<std::uint16_t*>(p); };
  // dWd = C + dy^T bf16(w h): the router weight on h's side, so dy is the rows as they came (in
  // table order in dy, or gathered again by dWd's producers: map_dy then unused).
  const CUtensorMap map_hw_rows = hopper::make_tensor_map(ptr(args.scratch_hw), M, I, 64);
  gemm::WgradProblem down{offsets, s.num_rows, Ei, Hi, Ii, Hi, {}};
  down.part[0] = {f32(args.acc_down), bf16(args.out_down)};
  if (dwd_gathers) down.gather = dy_rows;
  launch_wgrad(map_dy, map_hw_rows, down, args.carry_in, sms, stream);

  // dx = d_a @ Wg_e + d_b @ Wu_e: one GEMM over K = 2I, Wg then Wu ([El, I, H], N-major).
  const CUtensorMap map_dab =
      hopper::make_tensor_map(ptr(args.scratch_d_ab), M, 2 * I, gemm::kBlockM);
  const CUtensorMap map_wg = hopper::make_tensor_map(ptr(args.w_gate), El * I, H, 64);
  const CUtensorMap map_wu = hopper::make_tensor_map(ptr(args.w_up), El * I, H, 64);
  const gemm::Problem pdx{offsets, s.num_rows, Ei, Hi, 2 * Ii, Ii};
  kernels::launch<BLoad::kNMajor>(
      map_dab, map_wg, map_wu, pdx,
      kernels::StoreBf16{reinterpret_cast<std::uint16_t*>(args.out_dx), Hi}, sms, stream);

  // dWg, dWu = C + [d_a, d_b]^T x: one GEMM, C [2I, H] (gate rows first), or (dw1_mode 1, 2)
  // C^T = x^T [d_a, d_b] computed [H, 2I] and stored transposed (gate columns first), x then
  // being A: read from its table-ordered rows (1) or gathered by route from x_tokens (2), as dWd
  // gathers dy. The same products, each element's sum in the same order.
  const CUtensorMap map_dab_rows = hopper::make_tensor_map(ptr(args.scratch_d_ab), M, 2 * I, 64);
  // (x may be 0 where dW1 gathers its rows: the map is then never read)
  const CUtensorMap map_x_rows =
      args.x != 0 ? hopper::make_tensor_map(ptr(args.x), M, H, 64) : map_dab_rows;
  const bool transposed = args.dw1_mode != 0;
  gemm::WgradProblem gate_up{
      offsets, s.num_rows, Ei, transposed ? Hi : 2 * Ii, transposed ? 2 * Ii : Hi, Ii, {}};
  gate_up.part[0] = {f32(args.acc_gate), bf16(args.out_gate)};
  gate_up.part[1] = {f32(args.acc_up), bf16(args.out_up)};
  if (!transposed) {
    launch_wgrad(map_dab_rows, map_x_rows, gate_up, args.carry_in, sms, stream);
  } else {
    if (args.dw1_mode == 2) {
      gate_up.gather = {reinterpret_cast<const std::uint16_t*>(args.x_tokens),
                        reinterpret_cast<const std::int32_t*>(args.weight_route),
                        s.num_rows,
                        static_cast<int>(args.num_routes),
                        static_cast<int>(args.topk),
                        Hi,
                        nullptr};
    }
    launch_wgrad(map_x_rows, map_dab_rows, gate_up, args.carry_in, sms, stream, true);
  }
}

}  // namespace mok::bf16
