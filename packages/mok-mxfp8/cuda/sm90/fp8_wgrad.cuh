// The MXFP8 weight-gradient GEMM on sm_90a: for every local expert e,
//
//   out_e [R, C] = carry_e + sum over the 32-row blocks of segment e of A^T[rows] @ B[rows]
//
// with the rows (tokens) as the reduction. FP8 wgmma reads K-major operands only, so both come as
// transposed copies quantized along the rows: A^T E4M3 [R, M] and B^T E4M3 [C, M] (mok's
// quantizer's transposed output of [M, R] and [M, C]), their E8M0 scales block-major [M/32, R]
// and [M/32, C]. Segment starts and ends must be multiples of 32 (the layer's alignment), so a
// block never holds two experts' rows. (dWd_e = Q_rows(w dy)^T Q_rows(h): A^T = (w dy)^T, B^T =
// h^T; d[Wg; Wu]_e = Q_rows([d_a, d_b])^T Q_rows(x).)
//
// The forward kernel's pipeline (fp8_gemm.cuh: ring, scale copies and conversion, one wgmma per
// 32-slice into a fresh partial, rescaled and added on the CUDA cores) with what differs: the
// tile walk (expert, row tile of R, column tile of C: every expert has the same tiles), K per
// tile (the expert's segment, read from device memory), both operands' scales block-major, and
// the accumulators starting from an fp32 carry. Determinism (docs/determinism.md): an output
// element is one CTA's fp32 sum of its 32-row blocks' scaled partials in ascending row order,
// starting from the carry, so a split of the rows at any multiple of 32 into calls that carry the
// fp32 sums gives the same bits as one call.
#pragma once

#include <cstdint>

#include "fp8_gemm.cuh"
#include "mok/core/bf16.h"

namespace mok::mxfp8::gemm {

struct WgradProblem {
  const std::int64_t* offsets;  // [El + 1] segment starts (device), multiples of 32
  std::int64_t num_rows;        // M (offsets are clamped to [0, M])
  int num_experts;              // El
  int r;                        // output rows per expert: A^T's rows, a multiple of 64
  int c;                        // output columns: B^T's rows, a multiple of 64
};

struct WgradScales {
  const std::uint8_t* a;  // [M/32, R]: A^T row r's scale of row block j at a[j * R + r]
  const std::uint8_t* b;  // [M/32, C]
};

// The fp32 sums start from `carry` (nullptr: +0) and go to f32 and/or bf16 ([El * R, C] each,
// row-major; carry and f32 may be the same array).
struct WgradOut {
  const float* carry;
  float* f32;
  std::uint16_t* bf16;
};

__device__ inline int wgrad_row_tiles(const WgradProblem& p) {
  return (p.r + kBlockM - 1) / kBlockM;
}
__device__ inline int wgrad_col_tiles(const WgradProblem& p) {
  return (p.c + kBlockN - 1) / kBlockN;
}

// Tile t: expert, output rows [row0, row_end) of the [El * R, C] output, columns from col0
// (column tiles fastest, so the CTAs of a wave share A^T's tiles).
__device__ inline Tile wgrad_tile(const WgradProblem& p, int t) {
  const int per_expert = wgrad_row_tiles(p) * wgrad_col_tiles(p);
  const int e = t / per_expert, in = t % per_expert;
  const std::int64_t base = static_cast<std::int64_t>(e) * p.r;
  return {e, base + static_cast<std::int64_t>(in / wgrad_col_tiles(p)) * kBlockM, base + p.r,
          (in % wgrad_col_tiles(p)) * kBlockN};
}

// Expert e's rows [lo, hi) of the reduction, clamped as the forward's tile walk clamps them.
struct RowRange {
  std::int64_t lo, hi;
};
__device__ inline RowRange wgrad_rows(const WgradProblem& p, int e) {
  const std::int64_t lo = TileList::segment_start({p.offsets, p.num_rows, p.num_experts, 0, 0}, e);
  const std::int64_t hi = TileList::segment_end({p.offsets, p.num_rows, p.num_experts, 0, 0}, e);
  return {lo, hi};
}

// Stage kb of a row range: its first row and its 32-row slices (up to 4).
__device__ inline KBlock wgrad_block(const RowRange& rows, int kb) {
  const std::int64_t k0 = rows.lo + static_cast<std::int64_t>(kb) * kBlockK;
  const std::int64_t left = (rows.hi - k0) / kSliceK;
  return {static_cast<int>(k0), left < kSlices ? static_cast<int>(left) : kSlices, 0, 0, 0};
}

__device__ inline int wgrad_blocks(const RowRange& rows) {
  return static_cast<int>((rows.hi - rows.lo + kBlockK - 1) / kBlockK);
}

template <int kStagesT>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_wgrad_kernel(const __grid_constant__ CUtensorMap map_a,
                     const __grid_constant__ CUtensorMap map_b, WgradProblem p, WgradScales sc,
                     WgradOut out) {
  using R = Ring<kStagesT>;
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t full[kStagesT];   // tiles and scale bytes landed
  __shared__ alignas(8) std::uint64_t ready[kStagesT];  // fp32 scales written
  __shared__ alignas(8) std::uint64_t empty[kStagesT];  // the consumers are done with the stage

  const R ring{hopper::swizzle_base(smem_raw)};
  const Fp8Pipeline<kStagesT> pipe{{full, empty}, ready};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  pipe.init();
  const int total = p.num_experts * wgrad_row_tiles(p) * wgrad_col_tiles(p);

  if (threadIdx.x < 128) {  // ---------------------------------------------- producer
    // Warp 0: a stage's tiles by the copy engine (one lane) and its scale bytes (lane: slice
    // lane / 8, 16 rows of A^T and 16 of B^T from 16 (lane % 8) on); warps 1-3 convert them to
    // fp32 in turn, as in the forward kernel.
    Fp8Regs::producer();
    hopper::RingPos<kStagesT> pos;
    int n = 0;                                       // stages so far
    if (warp == 0 && lane == 0 && p.num_rows > 0) {  // no rows: the maps are not made
      hopper::prefetch_tensor_map(&map_a);
      hopper::prefetch_tensor_map(&map_b);
    }
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = wgrad_tile(p, t);
      const int a_row = static_cast<int>(tile.row0 - static_cast<std::int64_t>(tile.expert) * p.r);
      const RowRange rows = wgrad_rows(p, tile.expert);
      const int blocks = wgrad_blocks(rows);
      for (int kb = 0; kb < blocks; ++kb, ++n) {
        const KBlock k = wgrad_block(rows, kb);
        const int stage = pos.stage;
        if (warp == 0) {
          pipe.stages.acquire(pos);
          if (lane == 0) {
            pipe.stages.expect(stage, R::kStageBytes);
            hopper::tma_load_2d(ring.a(stage), &map_a, &full[stage], k.k0, a_row);
            hopper::tma_load_2d(ring.b(stage), &map_b, &full[stage], k.k0, tile.col0);
          }
          const int i = lane / 8, g = lane % 8;
          if (i < k.slices) {
            const std::int64_t block = k.k0 / kSliceK + i;
            if (a_row + 16 * g < p.r) {
              hopper::cp_async_16(ring.raw_a(stage) + kBlockM * i + 16 * g,
                                  sc.a + block * p.r + a_row + 16 * g);
            }
            if (tile.col0 + 16 * g < p.c) {
              hopper::cp_async_16(ring.raw_b(stage) + kBlockN * i + 16 * g,
                                  sc.b + block * p.c + tile.col0 + 16 * g);
            }
          }
          hopper::cp_async_arrive(&full[stage]);
        } else if (n % 3 == warp - 1) {
          pipe.stages.wait(pos);
#pragma unroll
          for (int s = 0; s < kSlices; ++s) {  // A^T's: [slice][128 rows], rows 4 lane ..
            const std::uint32_t w =
                reinterpret_cast<const std::uint32_t*>(ring.raw_a(stage) + kBlockM * s)[lane];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              ring.a_scale(stage, s)[4 * lane + r] =
                  scale_value(static_cast<std::uint8_t>(w >> (8 * r)));
            }
          }
          convert_b_scales(ring, stage, lane);  // B^T's, as the forward's B
          pipe.scales_ready(stage, lane);
        }
        pos.advance();
      }
    }
    return;
  }

  // ------------------------------------------------------------------------ consumers
  Fp8Regs::consumer();
  const int consumer = threadIdx.x / 128 - 1;  // 0 or 1: rows [64 c, 64 c + 64) of the tile
  hopper::RingPos<kStagesT> pos;
  Accumulators acc;
  float t[64];
  for (int tt = blockIdx.x; tt < total; tt += gridDim.x) {
    const Tile tile = wgrad_tile(p, tt);
#pragma unroll
    for (int q = 0; q < 64; ++q) acc.d[q] = 0.0f;
    if (out.carry != nullptr) {
      for_each_pair<kBlockN>(tile, consumer, p.c, [&](std::int64_t row, int col, int q) {
        const float2 v = *reinterpret_cast<const float2*>(out.carry + row * p.c + col);
        acc.d[q] = v.x;
        acc.d[q + 1] = v.y;
      });
    }
    const RowRange rows = wgrad_rows(p, tile.expert);
    const int blocks = wgrad_blocks(rows);
    for (int kb = 0; kb < blocks; ++kb) {
      const int slices = wgrad_block(rows, kb).slices;
      consume_stage(ring, pipe.wait(pos), slices, consumer, acc.d, t);
      pipe.release(pos, lane);
    }
    for_each_pair<kBlockN>(tile, consumer, p.c, [&](std::int64_t row, int col, int q) {
      const std::int64_t at = row * p.c + col;
      if (out.f32 != nullptr) {
        *reinterpret_cast<float2*>(out.f32 + at) = make_float2(acc.d[q], acc.d[q + 1]);
      }
      if (out.bf16 != nullptr) {
        *reinterpret_cast<std::uint32_t*>(out.bf16 + at) =
            static_cast<std::uint32_t>(core::float_to_bf16(acc.d[q])) |
            (static_cast<std::uint32_t>(core::float_to_bf16(acc.d[q + 1])) << 16);
      }
    });
  }
}

}  // namespace mok::mxfp8::gemm
