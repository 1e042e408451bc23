// The grouped SwiGLU forward on the GPU: two persistent wgmma GEMMs over the experts' segments.
//
//   gate/up:  [a, b] = x @ [Wg_e; Wu_e]^T  (one pass over x; 128 columns of each weight per tile,
//             one m64n256 wgmma for both), rounded to bf16 in the epilogue; at each tile's end
//             h = bf16(silu(a_c) * b_c) of its columns by mok-core's element math (the
//             reference's, bit for bit, given a and b), from the consumer's own rounded words
//             (swiglu_h_tile.cuh, as the megakernel's gate/up tasks): no pass reads a and b back
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
#include "swiglu_h_tile.cuh"

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
  std::uint16_t* h;  // or null: a and b only
  int inner;
  core::SwigluLimit limit;
  core::TableSigmoid sig;  // of `limit`, computed on the host (the same IEEE arithmetic)

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
  // h of the tile's columns, at once (the deferred pieces above carry a and b only).
  __device__ void at_tile_end(const Tile& tile, int consumer, const gemm::PackedBf16& p) const {
    if (h == nullptr) return;
    gemm::store_swiglu_h(h, inner, tile.row0 + 64 * consumer, tile.row_end, tile.col0, p, limit,
                         sig);
  }
};

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
                          reinterpret_cast<std::uint16_t*>(args.out_b),
                          reinterpret_cast<std::uint16_t*>(args.out_h),
                          static_cast<int>(I),
                          args.limit,
                          core::TableSigmoid::of(args.limit)};
  if (args.out_h != 0) core::ensure_sigmoid_table(stream);
  launch<BLoad::kPaired>(map_x, map_wg, map_wu, gate_up, e1, sms, stream);
  if (args.out_h == 0 || args.out_y == 0) return;

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
