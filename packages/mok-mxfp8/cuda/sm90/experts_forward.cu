// The MXFP8 grouped SwiGLU forward on the GPU (docs/mxfp8.md "Where the layer quantizes"):
//
//   gate/up:  [a, b] = x_q @ [Wg_e; Wu_e]^T  one FP8 GEMM over x's rows, 64 columns of each
//             weight per tile, rounded to bf16 in the epilogue
//   SwiGLU:   h = bf16(silu(a) * b) (mok-core's element math) and h_q = Q_I(h) (format.h's
//             quantizer, RCEIL), one elementwise kernel over the segments' rows
//   down:     y = h_q @ Wd_e^T                 (128 columns per tile)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "fp8_gemm.cuh"
#include "launch.cuh"
#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"
#include "mok/core/hopper.cuh"
#include "mok/core/sigmoid_table.cuh"
#include "mok/mxfp8/experts.h"
#include "mok/mxfp8/format.h"

namespace mok::mxfp8 {
namespace {

using gemm::Accumulators;
using gemm::BLoad;
using gemm::Tile;
using kernels::check;
using kernels::device_sms;
using kernels::launch;
using kernels::store_pair;
using kernels::StoreBf16;

constexpr int kGateUpN = gemm::kBlockN / 2;  // columns of each weight per tile

struct GateUpEpilogue {
  std::uint16_t* a;
  std::uint16_t* b;
  int inner;

  __device__ void operator()(const Tile& tile, int consumer, const Accumulators& acc) const {
    constexpr int kUp = kGateUpN / 2;  // the up columns' fragment registers follow the gate's
    gemm::for_each_pair<kGateUpN>(tile, consumer, inner, [&](std::int64_t row, int col, int q) {
      const std::int64_t at = row * inner + col;
      store_pair(a + at, core::float_to_bf16(acc.d[q]), core::float_to_bf16(acc.d[q + 1]));
      store_pair(b + at, core::float_to_bf16(acc.d[kUp + q]),
                 core::float_to_bf16(acc.d[kUp + q + 1]));
    });
  }
};

// h = swiglu_h(a, b) and its MXFP8 rows along I (hq_bytes apart), for the rows of the segments
// (tiles::for_each_row_range): a thread per 32-element block, 16-byte loads and stores.
__global__ void swiglu_hq_kernel(const std::uint16_t* a, const std::uint16_t* b, std::uint16_t* h,
                                 std::uint8_t* hq, std::int64_t hq_bytes,
                                 const std::int64_t* offsets, int num_experts,
                                 std::int64_t num_rows, int inner, core::SwigluLimit limit) {
  __shared__ int sorted;
  const auto sig = core::TableSigmoid::of(limit);  // sigmoid_table.cuh: the reference's bits
  const std::int64_t per_row = inner / kBlock;
  tiles::for_each_row_range(
      offsets, num_experts, num_rows, &sorted, [&](std::int64_t lo, std::int64_t hi) {
        const std::int64_t blocks = (hi - lo) * per_row;
        for (std::int64_t v = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
             v < blocks; v += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
          const std::int64_t row = lo + v / per_row, j = v % per_row;
          const std::int64_t at = row * inner + j * kBlock;
          std::uint32_t hw[kBlock / 2];  // the block's h, two bf16 per word
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const uint4 av = reinterpret_cast<const uint4*>(a + at)[w];
            const uint4 bv = reinterpret_cast<const uint4*>(b + at)[w];
            const uint4 hv = core::swiglu_h8(av, bv, limit, sig);
            hw[4 * w] = hv.x;
            hw[4 * w + 1] = hv.y;
            hw[4 * w + 2] = hv.z;
            hw[4 * w + 3] = hv.w;
            reinterpret_cast<uint4*>(h + at)[w] = hv;
          }
          std::uint32_t q[kBlock / 4] = {};  // the block's E4M3 bytes, four per word
          const std::uint8_t scale = quantize_block(
              kBlock, ScaleRule::kRceil,
              [&](int i) { return (i % 2 == 0 ? hw[i / 2] << 16 : hw[i / 2] & 0xFFFF0000u); },
              [&](int i, std::uint8_t byte) {
                q[i / 4] |= static_cast<std::uint32_t>(byte) << (8 * (i % 4));
              });
          std::uint8_t* out = hq + row * hq_bytes;
          reinterpret_cast<uint4*>(out + j * kBlock)[0] = make_uint4(q[0], q[1], q[2], q[3]);
          reinterpret_cast<uint4*>(out + j * kBlock)[1] = make_uint4(q[4], q[5], q[6], q[7]);
          out[inner + j] = scale;
        }
      });
}

}  // namespace

void grouped_forward_cuda(const MxGroupedForwardArgs& args, std::uintptr_t stream_handle) {
  const MxExpertShape& s = args.shape;
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int sms = args.num_sms > 0 ? static_cast<int>(args.num_sms) : device_sms();
  const std::uint64_t M = static_cast<std::uint64_t>(s.num_rows);
  const std::uint64_t H = static_cast<std::uint64_t>(s.hidden);
  const std::uint64_t I = static_cast<std::uint64_t>(s.inner);
  const std::uint64_t El = static_cast<std::uint64_t>(s.num_experts);
  const std::uint64_t row_bytes =
      args.x_row_bytes != 0 ? static_cast<std::uint64_t>(args.x_row_bytes) : H + H / kBlock;
  const auto ptr = [](std::uintptr_t p) { return reinterpret_cast<const void*>(p); };
  using hopper::MapType;

  const CUtensorMap map_x =
      hopper::make_tensor_map(ptr(args.x), M, H, tiles::kBlockM, MapType::kU8, row_bytes);
  const CUtensorMap map_wg =
      hopper::make_tensor_map(ptr(args.gate.data), El * I, H, kGateUpN, MapType::kU8);
  const CUtensorMap map_wu =
      hopper::make_tensor_map(ptr(args.up.data), El * I, H, kGateUpN, MapType::kU8);
  const tiles::Problem gate_up{reinterpret_cast<const std::int64_t*>(args.offsets), s.num_rows,
                               static_cast<int>(s.num_experts), static_cast<int>(I),
                               static_cast<int>(H)};
  const gemm::Scales gate_up_scales{reinterpret_cast<const std::uint8_t*>(args.x) + H,
                                    static_cast<std::int64_t>(row_bytes),
                                    reinterpret_cast<const std::uint8_t*>(args.gate.scales),
                                    reinterpret_cast<const std::uint8_t*>(args.up.scales)};
  const GateUpEpilogue e1{reinterpret_cast<std::uint16_t*>(args.out_a),
                          reinterpret_cast<std::uint16_t*>(args.out_b), static_cast<int>(I)};
  launch<BLoad::kPaired>(map_x, map_wg, map_wu, gate_up, gate_up_scales, e1, sms, stream);
  if (args.out_y == 0) return;

  // A thread per 32-block: 8 blocks of 128 threads per SM keep the element math's latency hidden.
  core::ensure_sigmoid_table(stream);
  swiglu_hq_kernel<<<8 * sms, 128, 0, stream>>>(
      reinterpret_cast<const std::uint16_t*>(args.out_a),
      reinterpret_cast<const std::uint16_t*>(args.out_b),
      reinterpret_cast<std::uint16_t*>(args.out_h), reinterpret_cast<std::uint8_t*>(args.out_hq),
      hq_row_bytes(s.inner), gate_up.offsets, gate_up.num_experts, s.num_rows, static_cast<int>(I),
      args.limit);
  check(cudaGetLastError(), "launching the SwiGLU kernel");

  const std::uint64_t hq_bytes = static_cast<std::uint64_t>(hq_row_bytes(s.inner));
  const CUtensorMap map_hq =
      hopper::make_tensor_map(ptr(args.out_hq), M, I, tiles::kBlockM, MapType::kU8, hq_bytes);
  const CUtensorMap map_wd =
      hopper::make_tensor_map(ptr(args.down.data), El * H, I, gemm::kBlockN, MapType::kU8);
  const tiles::Problem down{gate_up.offsets, s.num_rows, gate_up.num_experts, static_cast<int>(H),
                            static_cast<int>(I)};
  const gemm::Scales down_scales{reinterpret_cast<const std::uint8_t*>(args.out_hq) + I,
                                 static_cast<std::int64_t>(hq_bytes),
                                 reinterpret_cast<const std::uint8_t*>(args.down.scales), nullptr};
  const StoreBf16 e2{reinterpret_cast<std::uint16_t*>(args.out_y), static_cast<int>(H)};
  launch<BLoad::kSingle>(map_hq, map_wd, map_wd, down, down_scales, e2, sms, stream);
}

}  // namespace mok::mxfp8
