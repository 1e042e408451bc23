// The MXFP8 grouped GEMMs of the backward on the GPU (mok/mxfp8/experts.h):
//
// - grouped_gemm: out[rows of e] = A[rows of e] @ B_e^T with both operands quantized along K, the
//   orientation of the forward and of the input gradients (g = dy_q @ Q_H(Wd^T)^T; dx =
//   Q_2I([d_a, d_b]) @ [Q_I(Wg^T); Q_I(Wu^T)]^T, K split over the two transposed copies):
//   fp8_gemm.cuh's kernel, 128 output columns per tile;
// - grouped_wgrad: the weight gradients, rows as the reduction, from transposed copies quantized
//   along the rows: fp8_wgrad.cuh's kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fp8_gemm.cuh"
#include "fp8_wgrad.cuh"
#include "launch.cuh"
#include "mok/core/hopper.cuh"
#include "mok/mxfp8/experts.h"
#include "mok/mxfp8/format.h"

namespace mok::mxfp8 {

void grouped_gemm_cuda(const MxGroupedGemmArgs& args, std::uintptr_t stream_handle) {
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int sms = args.num_sms > 0 ? static_cast<int>(args.num_sms) : kernels::device_sms();
  const std::uint64_t M = static_cast<std::uint64_t>(args.num_rows);
  const std::uint64_t N = static_cast<std::uint64_t>(args.n);
  const std::uint64_t K = static_cast<std::uint64_t>(args.k);
  const std::uint64_t El = static_cast<std::uint64_t>(args.num_experts);
  const bool split = args.k_split != 0;
  const std::uint64_t K0 = split ? static_cast<std::uint64_t>(args.k_split) : K;
  // A's columns: K, or with a split the second weight's part from split_a_offset(K0) on.
  const std::uint64_t KA = static_cast<std::uint64_t>(split_a_cols(args.k, args.k_split));
  const std::uint64_t row_bytes =
      args.a_row_bytes != 0 ? static_cast<std::uint64_t>(args.a_row_bytes) : KA + KA / kBlock;
  const auto ptr = [](std::uintptr_t p) { return reinterpret_cast<const void*>(p); };
  using hopper::MapType;

  const CUtensorMap map_a =
      hopper::make_tensor_map(ptr(args.a), M, KA, tiles::kBlockM, MapType::kU8, row_bytes);
  const CUtensorMap map_b0 =
      hopper::make_tensor_map(ptr(args.b0_data), El * N, K0, gemm::kBlockN, MapType::kU8);
  const CUtensorMap map_b1 = split ? hopper::make_tensor_map(ptr(args.b1_data), El * N, K - K0,
                                                             gemm::kBlockN, MapType::kU8)
                                   : map_b0;
  tiles::Problem p{reinterpret_cast<const std::int64_t*>(args.offsets), args.num_rows,
                   static_cast<int>(El), static_cast<int>(N), static_cast<int>(K)};
  p.k_split = static_cast<int>(split ? K0 : 0);
  const gemm::Scales scales{reinterpret_cast<const std::uint8_t*>(args.a) + KA,
                            static_cast<std::int64_t>(row_bytes),
                            reinterpret_cast<const std::uint8_t*>(args.b0_scales),
                            reinterpret_cast<const std::uint8_t*>(args.b1_scales)};
  const int n = static_cast<int>(N);
  if (args.out_fp32) {
    const kernels::StoreF32 e{reinterpret_cast<float*>(args.out), n};
    if (split) {
      kernels::launch<gemm::BLoad::kSplitK>(map_a, map_b0, map_b1, p, scales, e, sms, stream);
    } else {
      kernels::launch<gemm::BLoad::kSingle>(map_a, map_b0, map_b1, p, scales, e, sms, stream);
    }
  } else {
    const kernels::StoreBf16 e{reinterpret_cast<std::uint16_t*>(args.out), n};
    if (split) {
      kernels::launch<gemm::BLoad::kSplitK>(map_a, map_b0, map_b1, p, scales, e, sms, stream);
    } else {
      kernels::launch<gemm::BLoad::kSingle>(map_a, map_b0, map_b1, p, scales, e, sms, stream);
    }
  }
}

void grouped_wgrad_cuda(const MxGroupedWgradArgs& args, std::uintptr_t stream_handle) {
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int sms = args.num_sms > 0 ? static_cast<int>(args.num_sms) : kernels::device_sms();
  const std::uint64_t M = static_cast<std::uint64_t>(args.num_rows);
  const std::uint64_t Rr = static_cast<std::uint64_t>(args.r);
  const std::uint64_t Cc = static_cast<std::uint64_t>(args.c);
  const auto ptr = [](std::uintptr_t p) { return reinterpret_cast<const void*>(p); };
  using hopper::MapType;
  const gemm::WgradProblem p{reinterpret_cast<const std::int64_t*>(args.offsets), args.num_rows,
                             static_cast<int>(args.num_experts), static_cast<int>(args.r),
                             static_cast<int>(args.c)};
  const gemm::WgradOut out{reinterpret_cast<const float*>(args.carry),
                           reinterpret_cast<float*>(args.out_f32),
                           reinterpret_cast<std::uint16_t*>(args.out_bf16)};
  using R = gemm::Ring<gemm::kStages>;
  constexpr auto kernel = gemm::fp8_wgrad_kernel<gemm::kStages>;
  kernels::check(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSharedBytes),
      "setting the shared memory size");
  const std::int64_t tiles = args.num_experts * ((args.r + tiles::kBlockM - 1) / tiles::kBlockM) *
                             ((args.c + gemm::kBlockN - 1) / gemm::kBlockN);
  const int grid = static_cast<int>(std::min<std::int64_t>(sms, tiles));
  if (M == 0) {  // no rows: no copy-engine maps over empty arrays; the kernel writes the carry
    const CUtensorMap none{};
    kernel<<<grid, gemm::kThreads, R::kSharedBytes, stream>>>(none, none, p, {nullptr, nullptr},
                                                              out);
  } else {
    const std::uint64_t a_row =
        args.a_row_bytes != 0 ? static_cast<std::uint64_t>(args.a_row_bytes) : M;
    const std::uint64_t b_row =
        args.b_row_bytes != 0 ? static_cast<std::uint64_t>(args.b_row_bytes) : M;
    const CUtensorMap map_a =
        hopper::make_tensor_map(ptr(args.a_data), Rr, M, tiles::kBlockM, MapType::kU8, a_row);
    const CUtensorMap map_b =
        hopper::make_tensor_map(ptr(args.b_data), Cc, M, gemm::kBlockN, MapType::kU8, b_row);
    const gemm::WgradScales scales{reinterpret_cast<const std::uint8_t*>(args.a_scales),
                                   reinterpret_cast<const std::uint8_t*>(args.b_scales)};
    kernel<<<grid, gemm::kThreads, R::kSharedBytes, stream>>>(map_a, map_b, p, scales, out);
  }
  kernels::check(cudaGetLastError(), "launching the FP8 weight-gradient GEMM");
}

}  // namespace mok::mxfp8
