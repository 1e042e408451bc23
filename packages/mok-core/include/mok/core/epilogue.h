// The fixed-order combine epilogue (docs/design.md §2, docs/core-runtime.md "Epilogue"): the
// per-element arithmetic, shared by the CPU loop (src/epilogue.cpp) and the CUDA kernel
// (cuda/epilogue.cu) so both give the reference's bits.
//
//   out[t, h] = bf16(acc),  acc = fp32(base[t, h]) or +0,
//               then for k ascending: acc = acc + fl(w[t, k] * fp32(rows[t*K + k, h]))
//
// Every step rounds to fp32 on its own: the product before the add (never a fused
// multiply-add), the add before the next k. On the device __fmul_rn/__fadd_rn forbid nvcc's
// contraction; host code must be compiled with -ffp-contract=off (mok_configure_target sets it;
// x86-64 without -march flags has no FMA to contract into anyway).
#pragma once

#include <cstdint>

#include "mok/core/bf16.h"
#include "mok/core/hd.h"
#include "mok/core/rounding.h"

namespace mok::core {

// The accumulator's start: fp32(base) when there is a base, else +0.
MOK_HD inline float combine_init(const std::uint16_t* base, std::int64_t index) {
  return base != nullptr ? bf16_to_float(base[index]) : 0.0f;
}

// One term of the sum: acc + fl(w * row), or acc + row without weights (w = 1 is exact).
MOK_HD inline float combine_step(float acc, std::uint16_t row, bool weighted, float w) {
  const float term = bf16_to_float(row);
  return add_rn(acc, weighted ? mul_rn(w, term) : term);
}

// out[t, h] of one element: base and rows have row stride `hidden`, weights are [T*K] or null.
MOK_HD inline std::uint16_t combine_element(const std::uint16_t* base, const std::uint16_t* rows,
                                            const float* weights, std::int64_t t, std::int64_t h,
                                            std::int64_t topk, std::int64_t hidden) {
  float acc = combine_init(base, t * hidden + h);
  for (std::int64_t k = 0; k < topk; ++k) {
    const std::int64_t route = t * topk + k;
    const float w = weights != nullptr ? weights[route] : 1.0f;
    acc = combine_step(acc, rows[route * hidden + h], weights != nullptr, w);
  }
  return float_to_bf16(acc);
}

}  // namespace mok::core
