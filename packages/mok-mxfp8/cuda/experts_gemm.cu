// One MXFP8 grouped GEMM on the GPU (grouped_gemm, mok/mxfp8/experts.h): out[rows of e] =
// A[rows of e] @ B_e^T with both operands quantized along K, the orientation of the forward and
// of the input gradients (g = dy_q @ Q_H(Wd^T)^T; dx = Q_2I([d_a, d_b]) @ [Q_I(Wg^T); Q_I(Wu^T)]^T,
// K split over the two transposed copies). fp8_gemm.cuh's kernel, 128 output columns per tile.
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8_gemm.cuh"
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
  const std::uint64_t row_bytes =
      args.a_row_bytes != 0 ? static_cast<std::uint64_t>(args.a_row_bytes) : K + K / kBlock;
  const auto ptr = [](std::uintptr_t p) { return reinterpret_cast<const void*>(p); };
  using hopper::MapType;

  const CUtensorMap map_a =
      hopper::make_tensor_map(ptr(args.a), M, K, tiles::kBlockM, MapType::kU8, row_bytes);
  const CUtensorMap map_b0 =
      hopper::make_tensor_map(ptr(args.b0_data), El * N, K0, gemm::kBlockN, MapType::kU8);
  const CUtensorMap map_b1 = split ? hopper::make_tensor_map(ptr(args.b1_data), El * N, K - K0,
                                                             gemm::kBlockN, MapType::kU8)
                                   : map_b0;
  tiles::Problem p{reinterpret_cast<const std::int64_t*>(args.offsets), args.num_rows,
                   static_cast<int>(El), static_cast<int>(N), static_cast<int>(K)};
  p.k_split = static_cast<int>(split ? K0 : 0);
  const gemm::Scales scales{reinterpret_cast<const std::uint8_t*>(args.a) + K,
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

}  // namespace mok::mxfp8
