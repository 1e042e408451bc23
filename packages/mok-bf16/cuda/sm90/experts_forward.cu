// The grouped SwiGLU forward on the GPU: two persistent wgmma GEMMs over the experts' segments.
//
//   gate/up:  [a, b] = x @ [Wg_e; Wu_e]^T  (one pass over x; 128 columns of each weight per tile,
//             one m64n256 wgmma for both), rounded to bf16 in the epilogue
//   SwiGLU:   h = bf16(silu(a_c) * b_c) by mok-core's element math (the reference's, bit for
//             bit, given a and b), an elementwise kernel over the segments' rows
//   down:     y = h @ Wd_e^T                (256 columns per tile)
#include <cuda_runtime.h>

#include <cstdint>

#include "grouped_gemm.cuh"
#include "launch.cuh"
#include "mok/bf16/experts.h"
#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"
#include "mok/core/hopper.cuh"
#include "mok/core/sigmoid_table.cuh"

namespace mok::bf16 {
namespace {

using gemm::Accumulators;
using gemm::BLoad;
using gemm::Tile;
using kernels::check;
using kernels::launch;

constexpr int kGateUpN = gemm::kMmaN / 2;  // columns of each weight per tile
constexpr int kDownN = gemm::kMmaN;

struct GateUpEpilogue {
  std::uint16_t* a;
  std::uint16_t* b;
  int inner;

  // Deferred (grouped_gemm.cuh): pieces of the packed pairs, a's columns (n8 blocks j < 16)
  // then b's.
  static constexpr bool kDeferred = true;
  template <int kChunk>
  __device__ void store(const Tile& tile, int consumer, const gemm::PackedBf16& p) const {
    constexpr int kUpBlocks = kGateUpN / 8;
    std::uint16_t* const to = kChunk < gemm::kDrainChunks / 2 ? a : b;
    gemm::for_each_vector_in_chunk<kChunk>(p, [&](int, int r, int j, const uint4& v) {
      const std::int64_t row = tile.row0 + 64 * consumer + r;
      const int col = tile.col0 + 8 * (j % kUpBlocks);
      if (row < tile.row_end && col < inner) *reinterpret_cast<uint4*>(to + row * inner + col) = v;
    });
  }
};

// h = swiglu_h(a, b) for the rows of the segments (tiles::for_each_row_range), 8 elements of
// a row per thread, the sigmoid looked up (sigmoid_table.cuh: the same bits without float64
// math). A kernel of its own, not the GEMM's epilogue: with the float64 sigmoid the element
// math cost the gate+up GEMM a third of its time, and with the table still 9 % (its unrolled
// code in every deferred store piece; NOTES.md, session 8) where this kernel costs ~5 %.
__global__ void swiglu_h_kernel(const std::uint16_t* a, const std::uint16_t* b, std::uint16_t* h,
                                const std::int64_t* offsets, int num_experts, std::int64_t num_rows,
                                int inner, core::SwigluLimit limit) {
  __shared__ int sorted;
  const auto sig = core::TableSigmoid::of(limit);
  tiles::for_each_row_range(
      offsets, num_experts, num_rows, &sorted, [&](std::int64_t lo, std::int64_t hi) {
        const std::int64_t vectors = (hi - lo) * inner / 8;
        for (std::int64_t v = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
             v < vectors; v += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
          const std::int64_t at = lo * inner + 8 * v;
          const uint4 av = *reinterpret_cast<const uint4*>(a + at);
          const uint4 bv = *reinterpret_cast<const uint4*>(b + at);
          *reinterpret_cast<uint4*>(h + at) = core::swiglu_h8(av, bv, limit, sig);
        }
      });
}

}  // namespace

void grouped_forward_cuda(const GroupedForwardArgs& args, std::uintptr_t stream_handle) {
  const ExpertShape& s = args.shape;
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int sms = args.num_sms > 0 ? static_cast<int>(args.num_sms) : kernels::device_sms();
  const auto* x = reinterpret_cast<const void*>(args.x);
  const std::uint64_t M = static_cast<std::uint64_t>(s.num_rows);
  const std::uint64_t H = static_cast<std::uint64_t>(s.hidden);
  const std::uint64_t I = static_cast<std::uint64_t>(s.inner);
  const std::uint64_t El = static_cast<std::uint64_t>(s.num_experts);

  if (args.zero_outside) {
    kernels::zero_uncovered_rows({{args.out_a, 2 * s.inner},
                                  {args.out_b, 2 * s.inner},
                                  {args.out_h, 2 * s.inner},
                                  {args.out_y, 2 * s.hidden}},
                                 reinterpret_cast<const std::int64_t*>(args.offsets),
                                 static_cast<int>(s.num_experts), s.num_rows, sms, stream);
  }
  const CUtensorMap map_x = hopper::make_tensor_map(x, M, H, gemm::kBlockM);
  const CUtensorMap map_wg =
      hopper::make_tensor_map(reinterpret_cast<const void*>(args.w_gate), El * I, H, kGateUpN);
  const CUtensorMap map_wu =
      hopper::make_tensor_map(reinterpret_cast<const void*>(args.w_up), El * I, H, kGateUpN);
  const gemm::Problem gate_up{reinterpret_cast<const std::int64_t*>(args.offsets), s.num_rows,
                              static_cast<int>(s.num_experts), static_cast<int>(s.inner),
                              static_cast<int>(s.hidden)};
  const GateUpEpilogue e1{reinterpret_cast<std::uint16_t*>(args.out_a),
                          reinterpret_cast<std::uint16_t*>(args.out_b), static_cast<int>(I)};
  launch<BLoad::kPaired>(map_x, map_wg, map_wu, gate_up, e1, sms, stream);
  if (args.out_h == 0) return;
  core::ensure_sigmoid_table(stream);
  // Eight 256-thread blocks per SM (it needs 30 registers): every warp slot, to hide the element
  // math's latency.
  swiglu_h_kernel<<<8 * sms, 256, 0, stream>>>(reinterpret_cast<const std::uint16_t*>(args.out_a),
                                               reinterpret_cast<const std::uint16_t*>(args.out_b),
                                               reinterpret_cast<std::uint16_t*>(args.out_h),
                                               gate_up.offsets, gate_up.num_experts, s.num_rows,
                                               static_cast<int>(I), args.limit);
  check(cudaGetLastError(), "launching the SwiGLU kernel");
  if (args.out_y == 0) return;

  const CUtensorMap map_h =
      hopper::make_tensor_map(reinterpret_cast<const void*>(args.out_h), M, I, gemm::kBlockM);
  const CUtensorMap map_wd =
      hopper::make_tensor_map(reinterpret_cast<const void*>(args.w_down), El * H, I, kDownN);
  const gemm::Problem down{gate_up.offsets, s.num_rows, gate_up.num_experts,
                           static_cast<int>(s.hidden), static_cast<int>(s.inner)};
  const kernels::StoreBf16 e2{reinterpret_cast<std::uint16_t*>(args.out_y), static_cast<int>(H)};
  launch<BLoad::kKMajor>(map_h, map_wd, map_wd, down, e2, sms, stream);
}

}  // namespace mok::bf16
