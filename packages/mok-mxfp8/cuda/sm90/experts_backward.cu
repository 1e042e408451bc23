// The MXFP8 backward's element pass on the GPU (grouped_swiglu_backward, mok/mxfp8/experts.h):
// everything between the backward's GEMMs in one launch.
//
//   g = dy_q @ Q(Wd_e)          (grouped_gemm, before)
//   this pass                   h, d_a, d_b, d_w;  Q_2I([d_a, d_b]) as MXFP8 rows (dx's A);
//                               [d_a, d_b], h, bf16(x), bf16(w dy) quantized along the rows (the
//                               weight gradients' operands)
//   dx, dWg/dWu, dWd            (grouped_gemm, grouped_wgrad, after)
//
// A CTA takes one 32-row block, the block of the transposed copies' scales, and walks its
// columns 64 at a time: thread t holds row t / 8, columns 8 (t % 8) .. + 8 of the step, so the
// four lanes of a 32-column block are neighbours in a warp (the row quantization merges their
// statistics with shuffles, lanes.cuh). The step's values go to shared memory as bf16 tiles
// [32 rows, 64 columns]; a thread per column then quantizes its 32 rows (format.h's
// quantize_block) and stores 32 bytes of the transposed copy and its scale, while the warp left
// over adds the step's products g_i h_i to d_w, a thread per row in ascending i: the reference's
// sequential sum. blockIdx.y picks the SwiGLU part (y = 0: columns of I) or the activations' part
// (y = 1: columns of H).
#include <cuda_runtime.h>

#include <cstdint>

#include "../lanes.cuh"
#include "launch.cuh"
#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"
#include "mok/core/rounding.h"
#include "mok/core/sigmoid_table.cuh"
#include "mok/mxfp8/experts.h"
#include "mok/mxfp8/format.h"

namespace mok::mxfp8 {
namespace {

using kernels::check;

constexpr int kThreads = 256;
constexpr int kStep = 64;                   // columns per step
constexpr int kPer = 8;                     // columns per thread and step
constexpr int kRowLanes = kStep / kPer;     // threads per row
constexpr int kBlockLanes = kBlock / kPer;  // threads per 32-column block
static_assert(kThreads == kBlock * kRowLanes, "a thread per (row, 8 columns) of a step");

struct Params {
  const float* g;
  const std::uint16_t* a;
  const std::uint16_t* b;
  const float* router_weights;  // null: all ones
  const std::uint8_t* x;
  const std::uint8_t* dy;
  std::int64_t x_bytes, dy_bytes, dab_bytes;
  int dab_d_b, dab_cols;  // dx's A (grouped_gemm's split layout): d_b's first column, K_A
  float* d_w;
  std::uint8_t* dab;
  std::uint8_t *dab_t, *dab_t_scales, *h_t, *h_t_scales;
  std::uint8_t *x_t, *x_t_scales, *wdy_t, *wdy_t_scales;
  std::int64_t num_rows;
  int hidden, inner;
  core::SwigluLimit limit;
};

// A step's values of one tensor: bf16 bits [32 rows][64 columns].
struct StepTile {
  alignas(16) std::uint16_t v[kBlock][kStep];
};

// A step's products fl(g_i h_i), [32 rows][64 columns] (a padded row: the summing warp's lanes
// read 32 rows of one column without bank conflicts).
struct StepProducts {
  float v[kBlock][kStep + 1];
};

struct Shared {
  StepTile tiles[3];
  StepProducts products;
};

// Where a transposed copy of C columns goes: E4M3 [C, M], E8M0 [M/32, C].
struct Transposed {
  std::uint8_t* data;
  std::uint8_t* scales;
  std::int64_t cols;
};

// Column `col` (of the step) of `tile` quantized along its 32 rows into column c of `out`, at
// the rows of 32-row block `blk`.
__device__ inline void quantize_column(const StepTile& tile, int col, const Transposed& out,
                                       std::int64_t c, std::int64_t blk, std::int64_t M) {
  std::uint32_t q[kBlock / 4] = {};
  const std::uint8_t scale = quantize_block(
      kBlock, ScaleRule::kRceil,
      [&](int i) { return static_cast<std::uint32_t>(tile.v[i][col]) << 16; },
      [&](int i, std::uint8_t byte) {
        q[i / 4] |= static_cast<std::uint32_t>(byte) << (8 * (i % 4));
      });
  auto* data = reinterpret_cast<uint4*>(out.data + c * M + blk * kBlock);
  data[0] = make_uint4(q[0], q[1], q[2], q[3]);
  data[1] = make_uint4(q[4], q[5], q[6], q[7]);
  out.scales[blk * out.cols + c] = scale;
}

// This lane's 8 bf16 values (bits) of a 32-column block held by 4 neighbouring lanes, quantized
// along the row: 8 bytes at `data`, the block's scale at `scale` (by the block's first lane).
__device__ inline void quantize_row_piece(const std::uint16_t (&v16)[kPer], std::uint8_t* data,
                                          std::uint8_t* scale, bool first) {
  std::uint32_t v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = static_cast<std::uint32_t>(v16[i]) << 16;
  const BlockStats stats = kernels::lane_block_stats<kBlockLanes>(v);
  const int e = stats.exponent(ScaleRule::kRceil);
  std::uint32_t packed[kPer / 4];
  kernels::lane_block_bytes(stats, e, v, packed);
  *reinterpret_cast<uint2*>(data) = make_uint2(packed[0], packed[1]);
  if (first) *scale = stats.scale(e);
}

__device__ inline void store_tile_row(StepTile& tile, int r, int j,
                                      const std::uint16_t (&v)[kPer]) {
  std::uint32_t w[kPer / 2];
#pragma unroll
  for (int i = 0; i < kPer / 2; ++i) {
    w[i] = static_cast<std::uint32_t>(v[2 * i]) | (static_cast<std::uint32_t>(v[2 * i + 1]) << 16);
  }
  *reinterpret_cast<uint4*>(&tile.v[r][kPer * j]) = make_uint4(w[0], w[1], w[2], w[3]);
}

// y = 0: the SwiGLU backward of the block's rows over the columns of I.
__device__ void swiglu_part(const Params& p, Shared& sh, std::int64_t blk) {
  const int t = threadIdx.x, r = t / kRowLanes, j = t % kRowLanes;
  const std::int64_t row = blk * kBlock + r, M = p.num_rows;
  const int I = p.inner;
  const auto sig = core::TableSigmoid::of(p.limit);  // sigmoid_table.cuh: the reference's bits
  const float w = p.router_weights == nullptr ? 1.0f : p.router_weights[row];
  const Transposed h_t{p.h_t, p.h_t_scales, I};
  // d_a's copy then d_b's: rows [0, I) and [I, 2I) of dab_t, scales [2][M/32][I].
  const Transposed da_t{p.dab_t, p.dab_t_scales, I};
  const Transposed db_t{p.dab_t + static_cast<std::int64_t>(I) * M, p.dab_t_scales + M / kBlock * I,
                        I};
  std::uint8_t* dab_row = p.dab + row * p.dab_bytes;
  constexpr int kSummer = 3 * kStep;  // the first thread of the warp that sums d_w
  float d_w = 0.0f;                   // row t - kSummer's sum (in that warp)
  for (int c0 = 0; c0 < I; c0 += kStep) {
    const int col = c0 + kPer * j;
    const std::int64_t at = row * I + col;
    const uint4 av = *reinterpret_cast<const uint4*>(p.a + at);
    const uint4 bv = *reinterpret_cast<const uint4*>(p.b + at);
    const float4 g0 = *reinterpret_cast<const float4*>(p.g + at);
    const float4 g1 = *reinterpret_cast<const float4*>(p.g + at + 4);
    const std::uint32_t aw[4] = {av.x, av.y, av.z, av.w};
    const std::uint32_t bw[4] = {bv.x, bv.y, bv.z, bv.w};
    const float gs[kPer] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    std::uint16_t h[kPer], d_a[kPer], d_b[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const auto half = [&](const std::uint32_t (&words)[4]) {
        return static_cast<std::uint16_t>(i % 2 == 0 ? words[i / 2] : words[i / 2] >> 16);
      };
      const core::SwigluGrad e = core::swiglu_backward(gs[i], w, half(aw), half(bw), p.limit, sig);
      sh.products.v[r][kPer * j + i] = core::mul_rn(gs[i], e.h);
      h[i] = core::float_to_bf16(e.h);
      d_a[i] = e.d_a;
      d_b[i] = e.d_b;
    }
    // dx's A: [d_a, d_b] as MXFP8 rows in grouped_gemm's split layout (d_b from dab_d_b on).
    const bool first = j % kBlockLanes == 0;
    quantize_row_piece(d_a, dab_row + col, dab_row + p.dab_cols + col / kBlock, first);
    quantize_row_piece(d_b, dab_row + p.dab_d_b + col,
                       dab_row + p.dab_cols + (p.dab_d_b + col) / kBlock, first);
    store_tile_row(sh.tiles[0], r, j, h);
    store_tile_row(sh.tiles[1], r, j, d_a);
    store_tile_row(sh.tiles[2], r, j, d_b);
    __syncthreads();
    if (t < kSummer) {
      const int which = t / kStep, c = t % kStep;
      if (which == 0) {
        quantize_column(sh.tiles[0], c, h_t, c0 + c, blk, M);
      } else {
        quantize_column(sh.tiles[which], c, which == 1 ? da_t : db_t, c0 + c, blk, M);
      }
    } else if (t < kSummer + kBlock) {
      for (int i = 0; i < kStep; ++i) d_w = core::add_rn(d_w, sh.products.v[t - kSummer][i]);
    }
    __syncthreads();  // the tiles are rewritten by the next step
  }
  if (t >= kSummer && t < kSummer + kBlock) p.d_w[blk * kBlock + t - kSummer] = d_w;
}

// Eight E4M3 bytes of an MXFP8 row times their block's scale: exact fp32 values.
__device__ inline void row_values(const std::uint8_t* row, int col, int cols, float (&out)[kPer]) {
  const uint2 bytes = *reinterpret_cast<const uint2*>(row + col);
  const float scale = scale_value(row[cols + col / kBlock]);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const std::uint32_t word = i < 4 ? bytes.x : bytes.y;
    out[i] = core::mul_rn(decode_e4m3(static_cast<std::uint8_t>(word >> (8 * (i % 4)))), scale);
  }
}

// y = 1: bf16(x) and bf16(w dy) of the block's MXFP8 rows over the columns of H.
__device__ void activation_part(const Params& p, StepTile (&tiles)[3], std::int64_t blk) {
  const int t = threadIdx.x, r = t / kRowLanes, j = t % kRowLanes;
  const std::int64_t row = blk * kBlock + r, M = p.num_rows;
  const int H = p.hidden;
  const float w = p.router_weights == nullptr ? 1.0f : p.router_weights[row];
  const Transposed x_t{p.x_t, p.x_t_scales, H}, wdy_t{p.wdy_t, p.wdy_t_scales, H};
  for (int c0 = 0; c0 < H; c0 += kStep) {
    const int col = c0 + kPer * j;
    float xv[kPer], dyv[kPer];
    row_values(p.x + row * p.x_bytes, col, H, xv);
    row_values(p.dy + row * p.dy_bytes, col, H, dyv);
    std::uint16_t xb[kPer], wdy[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      xb[i] = core::float_to_bf16(xv[i]);
      wdy[i] = core::weighted_bf16(w, dyv[i]);
    }
    store_tile_row(tiles[0], r, j, xb);
    store_tile_row(tiles[1], r, j, wdy);
    __syncthreads();
    if (t < 2 * kStep) {
      const int c = t % kStep;
      quantize_column(tiles[t / kStep], c, t < kStep ? x_t : wdy_t, c0 + c, blk, M);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(Params p) {
  __shared__ Shared sh;
  if (blockIdx.y == 0) {
    swiglu_part(p, sh, blockIdx.x);
  } else {
    activation_part(p, sh.tiles, blockIdx.x);
  }
}

}  // namespace

void grouped_swiglu_backward_cuda(const MxSwigluBackwardArgs& a, std::uintptr_t stream_handle) {
  auto* stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const std::int64_t H = a.hidden, I = a.inner;
  const auto u8 = [](std::uintptr_t v) { return reinterpret_cast<std::uint8_t*>(v); };
  Params p{};
  p.g = reinterpret_cast<const float*>(a.g);
  p.a = reinterpret_cast<const std::uint16_t*>(a.a);
  p.b = reinterpret_cast<const std::uint16_t*>(a.b);
  p.router_weights = reinterpret_cast<const float*>(a.router_weights);
  p.x = u8(a.x);
  p.dy = u8(a.dy);
  p.x_bytes = a.x_row_bytes != 0 ? a.x_row_bytes : H + H / kBlock;
  p.dy_bytes = a.dy_row_bytes != 0 ? a.dy_row_bytes : H + H / kBlock;
  p.dab_d_b = static_cast<int>(split_a_offset(I));
  p.dab_cols = static_cast<int>(split_a_cols(2 * I, I));
  p.dab_bytes = a.dab_row_bytes != 0 ? a.dab_row_bytes : p.dab_cols + p.dab_cols / kBlock;
  p.d_w = reinterpret_cast<float*>(a.out_d_w);
  p.dab = u8(a.out_dab);
  p.dab_t = u8(a.dab_t_data);
  p.dab_t_scales = u8(a.dab_t_scales);
  p.h_t = u8(a.h_t_data);
  p.h_t_scales = u8(a.h_t_scales);
  p.x_t = u8(a.x_t_data);
  p.x_t_scales = u8(a.x_t_scales);
  p.wdy_t = u8(a.wdy_t_data);
  p.wdy_t_scales = u8(a.wdy_t_scales);
  p.num_rows = a.num_rows;
  p.hidden = static_cast<int>(H);
  p.inner = static_cast<int>(I);
  p.limit = a.limit;
  if (a.num_rows == 0) return;
  core::ensure_sigmoid_table(stream);
  const dim3 grid(static_cast<unsigned>(a.num_rows / kBlock), 2);
  swiglu_backward_kernel<<<grid, kThreads, 0, stream>>>(p);
  check(cudaGetLastError(), "launching the MXFP8 backward's element pass");
}

}  // namespace mok::mxfp8
