// h = swiglu_h(a, b) at a paired gate/up tile's end, from the consumer's packed words: what the
// megakernel's gate/up tasks (moe_forward.cu) and the chain's gate/up GEMM (experts_forward.cu)
// store there, so that no pass of its own reads a and b back.
#pragma once

#include <cstdint>

#include "grouped_gemm.cuh"
#include "mok/core/expert_math.h"
#include "mok/core/sigmoid_table.cuh"

namespace mok::bf16::gemm {

// The consumer warpgroup's 64 rows of h for a paired tile (128 columns of each weight from
// `col0`), from its packed words (PackedBf16, the quads' layout): the thread's a and b vectors of
// the same 8 columns are w.v[2 k + half] and w.v[2 (k + 4) + half], k < 4, so each thread
// computes h of its own columns and stores 16 bytes (rows from `first`, those below `row_end`;
// columns below `inner`). core::swiglu_h8, the reference's element math, on the same rounded a
// and b the context keeps: the same bits. The accumulators are dead by now: a caller that sets them
// to constants first frees their registers for the lookups and the element math. Row: the caller's
// row index type (the megakernel's int rows keep its register count).
template <class Row>
__device__ inline void store_swiglu_h_clamped(std::uint16_t* h, int inner, Row first, Row row_end,
                                              int col0, const PackedBf16& w,
                                              core::SwigluLimit limit,
                                              const core::TableSigmoid& sig) {
  const int t = threadIdx.x % 128;
  // Every vector's sigmoids first (core::gate_sigmoids8: one round trip to the table for the 64),
  // then the element math and the stores.
  core::Sigmoid8 s[kDrainChunks];  // vector 2 k + half
#pragma unroll
  for (int v = 0; v < kDrainChunks; ++v) s[v] = core::gate_sigmoids8(w.v[v], limit, sig);
#pragma unroll
  for (int k = 0; k < kDrainChunks / 2; ++k) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const Row row = first + tiles::frag_row(t, 2 * half);
      const int col = col0 + 8 * (4 * k + t % 4);
      if (row < row_end && col < inner) {
        *reinterpret_cast<uint4*>(h + static_cast<std::int64_t>(row) * inner + col) =
            core::swiglu_h8(w.v[2 * k + half], w.v[2 * (k + 4) + half], limit, s[2 * k + half]);
      }
    }
  }
}

// The same, with the clamp off passed as a constant where it is (core::with_swiglu_limit): its
// element math then carries no clamps nor the table's test for the limit.
template <class Row>
__device__ inline void store_swiglu_h(std::uint16_t* h, int inner, Row first, Row row_end, int col0,
                                      const PackedBf16& w, core::SwigluLimit limit,
                                      const core::TableSigmoid& sig) {
  core::with_swiglu_limit(limit, [&](core::SwigluLimit lim) {
    store_swiglu_h_clamped(h, inner, first, row_end, col0, w, lim, sig);
  });
}

}  // namespace mok::bf16::gemm
