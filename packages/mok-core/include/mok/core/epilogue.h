// The fixed-order combine epilogue (docs/design.md §2, docs/core-runtime.md "Epilogue"): the
// per-element arithmetic, shared by the CPU loop (src/epilogue.cpp) and the CUDA kernel
// (cuda/epilogue.cu) so both give the reference's bits.
//
//   out[t, h] = bf16(acc),  acc = fp32(base[t, h]) or +0,
//               then for k ascending: acc = acc + fl(w[t, k] * fp32(rows[r(t*K + k), h]))
//
// where r(route) = route, or with a row index (a route's row in a table-ordered `rows`, as the
// schedule's route_row) r(route) = row_index[route]; a route whose row lies outside
// [0, num_rows) (a route the schedule left out) adds no term.
//
// Every step rounds to fp32 on its own: the product before the add (never a fused
// multiply-add), the add before the next k. On the device __fmul_rn/__fadd_rn forbid nvcc's
// contraction; host code must be compiled with -ffp-contract=off (mok_configure_target sets it;
// x86-64 without -march flags has no FMA to contract into anyway).
#pragma once

#include <cstddef>
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

// The row of `rows` that holds `route`'s term: the route itself, or row_index[route]; -1 when
// that row lies outside [0, num_rows) (no term).
MOK_HD inline std::int64_t combine_row(std::int64_t route, const std::int32_t* row_index,
                                       std::int64_t num_rows) {
  if (row_index == nullptr) return route;
  const std::int64_t row = row_index[route];
  return row >= 0 && row < num_rows ? row : -1;
}

// out[t, h] of one element: base and rows have row stride `hidden`, weights are [T*K] or null,
// row_index [T*K] or null (then num_rows is unused).
MOK_HD inline std::uint16_t combine_element(const std::uint16_t* base, const std::uint16_t* rows,
                                            const float* weights, const std::int32_t* row_index,
                                            std::int64_t num_rows, std::int64_t t, std::int64_t h,
                                            std::int64_t topk, std::int64_t hidden) {
  float acc = combine_init(base, t * hidden + h);
  for (std::int64_t k = 0; k < topk; ++k) {
    const std::int64_t route = t * topk + k;
    const std::int64_t row = combine_row(route, row_index, num_rows);
    if (row < 0) continue;
    const float w = weights != nullptr ? weights[route] : 1.0f;
    acc = combine_step(acc, rows[row * hidden + h], weights != nullptr, w);
  }
  return float_to_bf16(acc);
}

// The arguments of a combine (src/epilogue_impl.h's combine; mok_core.combine in Python;
// mok-bf16's forward call through EntryPoints, entry_points.h). Pointers are addresses.
// Bytes of the error words a combine publishes (transport.h's kErrorWords int32 words).
inline constexpr std::size_t kErrorMirrorBytes = 16;

struct CombineArgs {
  std::uintptr_t out = 0;      // bf16 [T, H]
  std::uintptr_t base = 0;     // bf16 [T, H], or 0: none
  std::uintptr_t rows = 0;     // bf16 [T*K, H], or [num_rows, H] with a row index
  std::uintptr_t weights = 0;  // fp32 [T*K], or 0: all ones
  std::int64_t num_tokens = 0;
  std::int64_t topk = 0;
  std::int64_t hidden = 0;
  std::uintptr_t row_index = 0;  // int32 [T*K]: each route's row of `rows`, or 0: row t*K + k
  std::int64_t num_rows = 0;     // rows of `rows` (with a row index)
  // Optional, both or neither: the transport's error words (int32 [4], device) and an
  // ErrorMirror's device address; the combine copies the words there behind the stream's work
  // (on the GPU its first thread, or a 16-byte copy where there is nothing to combine): the
  // call's last step publishes them, with no copy of its own.
  std::uintptr_t error = 0;
  std::uintptr_t error_mirror = 0;
};

}  // namespace mok::core
