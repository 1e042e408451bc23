// The MXFP8 grouped GEMM on sm_90a: C_e = A[rows of segment e] @ B_e^T for every local expert e,
// A and B E4M3 with one E8M0 scale per 32 elements along K (docs/mxfp8.md "Arithmetic"), fp32
// accumulators, an epilogue per output tile. The structure of mok-bf16's grouped GEMM (the tile
// walk of mok/core/grouped_tiles.cuh, a persistent warp-specialised CTA, a ring of stages filled
// by the copy engine), with what block scales add:
//
// - Every 32-deep slice of K is one wgmma m64n128k32 into a fresh fp32 partial T (scale-d 0);
//   the consumer then adds it on the CUDA cores: acc = fma(T, 2^(e_a + e_b), acc), the scale of
//   the element's row times that of its column, both powers of two, so the product is exact
//   and fma rounds once, as the reference's "partial times scale, added" does.
// - Both operands are K-major (FP8 wgmma reads no transposed operand): weights as
//   mok.mxfp8_quantize lays them out, [El, N, K] E4M3 with block-major scales [El, K/32, N];
//   activations as MXFP8 rows (E4M3 [rows, K] at any 16-byte row stride, the row's K/32 scale
//   bytes at their own stride).
// - The scales travel beside the tiles: the producer warp copies a stage's E8M0 bytes (A's
//   128 rows x 4 slices, B's 4 slices x 128 columns) into shared memory with asynchronous
//   copies that arrive on the stage's `full` barrier with the copy engine's loads; three more
//   warps, in turn, make them fp32 and arrive on `ready`. The consumers wait for both and read
//   ready fp32 scales.
//
// A stage is 128 elements of K: A [128 x 128] and B [128 x 128] E4M3 (one 128-byte swizzle row
// each), 4 slices. K must be a multiple of 64; the last stage may have 2 slices.
//
// Determinism (docs/determinism.md): an output element is one CTA's fp32 sum of its 32-slices'
// scaled partials in ascending K, with no split of K; nothing depends on the CTA, the grid, the
// tile's position in A or the other rows of the tile (batch invariant, invariant under any split of
// the rows into calls). The wgmma's partial is the tensor cores' fixed-order sum of 32 products.
#pragma once

#include <cstdint>

#include "mok/core/grouped_tiles.cuh"
#include "mok/core/hopper.cuh"
#include "mok/core/pipeline.cuh"
#include "mok/mxfp8/format.h"

namespace mok::mxfp8::gemm {

using tiles::for_each_pair;
using tiles::frag_row;
using tiles::kBlockM;
using tiles::kMaxExperts;
using tiles::locate;
using tiles::Problem;
using tiles::Tile;
using tiles::TileList;

inline constexpr int kBlockK = 128;  // K per stage: one 128-byte swizzle row of E4M3
inline constexpr int kSliceK = 32;   // K per wgmma and per scale
inline constexpr int kSlices = kBlockK / kSliceK;
inline constexpr int kBlockN = 128;  // B rows per tile (64 of each weight when paired)
inline constexpr int kThreads = 384;
inline constexpr int kStages = 5;
// Registers of the FP8 GEMMs' warpgroups: the producer converts scales as well as copying (the
// split checked against the CTA's pool by hopper::RegisterSplit).
using Fp8Regs = hopper::RegisterSplit<88, 208>;

// Where B comes from. kSingle: one weight, 128 output columns per tile. kPaired: two weights
// against the same rows (gate and up), 64 columns of each per tile, a thread's accumulators
// holding the same columns of both (fragment blocks j < 8 the first's, j >= 8 the second's).
// kSplitK: K split over two weights, K' = k_split from the first then k - k_split from the
// second (dx = [d_a, d_b] @ [Wg; Wu] reads the transposed copies of Wg and Wu one after the
// other), 128 output columns per tile; k_split a multiple of 64: the first weight's last stage
// may have 2 slices, and A holds the second weight's part from k_split rounded up to 128 on
// (experts.h split_a_offset), so every stage of A starts at a multiple of 128.
enum class BLoad { kSingle, kPaired, kSplitK };

// The operands' scales (E8M0 bytes). A's are read 4 bytes (a stage's 4 slices of a row) at a
// time, B's 16 (16 columns of a slice): `a` and a_stride multiples of 4, b0 and b1 of 16 (the
// host checks); a row's bytes past K/32 may be read when K is not a multiple of 128 (a row of
// MXFP8 rows at a 16-byte stride has them), never used.
struct Scales {
  const std::uint8_t* a;   // A's: scale j of row r at a[r * a_stride + j]
  std::int64_t a_stride;   // bytes between rows' scales
  const std::uint8_t* b0;  // B's first weight: [El, K/32, N]
  const std::uint8_t* b1;  // the second weight (kPaired, kSplitK), else unused
};

// A stage of the ring in shared memory: the E4M3 tiles (1024-byte aligned), the scale bytes as
// copied (A: [128 rows][4 slices], B: [4 slices][128 columns]) and as fp32.
template <int kStages_>
struct Ring {
  static constexpr int kABytes = kBlockM * kBlockK;
  static constexpr int kBBytes = kBlockN * kBlockK;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kRawBytes = kSlices * (kBlockM + kBlockN);
  static constexpr int kBSlice = 4 * 36;  // floats of a slice's B scales (b_index)
  static constexpr int kScaleFloats = kSlices * (kBlockM + kBSlice);
  static constexpr int kSharedBytes =
      kStages_ * (kStageBytes + kRawBytes + kScaleFloats * 4) + 1024;  // + the tiles' alignment

  unsigned char* base;
  __device__ unsigned char* a(int s) const { return base + s * kStageBytes; }
  __device__ unsigned char* b(int s) const { return a(s) + kABytes; }
  __device__ unsigned char* raw_a(int s) const {
    return base + kStages_ * kStageBytes + s * kRawBytes;
  }
  __device__ unsigned char* raw_b(int s) const { return raw_a(s) + kSlices * kBlockM; }
  // Slice i's scales of the tile's rows (a_scale, in row order) and B rows (b_scale, B row r at
  // b_index(r): a consumer thread's 32 columns contiguous), fp32.
  __device__ float* a_scale(int s, int i) const {
    return reinterpret_cast<float*>(base + kStages_ * (kStageBytes + kRawBytes)) +
           s * kScaleFloats + i * kBlockM;
  }
  __device__ float* b_scale(int s, int i) const {
    return a_scale(s, 0) + kSlices * kBlockM + i * kBSlice;
  }
  // The wgmma fragment gives thread t the B rows 8 j + 2 (t % 4) + {0, 1}, j = 0..15: those
  // of t % 4 = q are the 32 floats from 36 q on, in j order (8 loads of 16 bytes; the 4 floats
  // of padding put the four q's loads in different banks).
  __device__ static int b_index(int r) { return (r % 8 / 2) * 36 + (r / 8) * 2 + r % 2; }
};

// A stage of K: where it starts in A, how many 32-slices it has (4, or 2 at the end of a
// weight's K), which weight it reads (kSplitK: 1 past k_split) and where it starts in that
// weight's K.
struct KBlock {
  int k0;
  int slices;
  int weight;
  int b_k0;
  int b_k;  // that weight's K
};

__device__ inline int k_blocks_of(int k) { return (k + kBlockK - 1) / kBlockK; }

__device__ inline int k_blocks(const Problem& p) {
  return p.k_split > 0 ? k_blocks_of(p.k_split) + k_blocks_of(p.k - p.k_split) : k_blocks_of(p.k);
}

__device__ inline KBlock k_block(const Problem& p, int kb) {
  const int first = p.k_split > 0 ? k_blocks_of(p.k_split) : k_blocks_of(p.k);
  const int weight = kb < first ? 0 : 1;
  const int b_k0 = (weight == 0 ? kb : kb - first) * kBlockK;
  const int b_k = p.k_split > 0 ? (weight == 0 ? p.k_split : p.k - p.k_split) : p.k;
  const int left = (b_k - b_k0) / kSliceK;
  const int a_k1 = (p.k_split + kBlockK - 1) / kBlockK * kBlockK;  // the second weight's start in A
  return {weight == 0 ? b_k0 : a_k1 + b_k0, left < kSlices ? left : kSlices, weight, b_k0, b_k};
}

// The accumulators of one consumer warpgroup: 64 rows x 128 columns.
struct Accumulators {
  float d[64];
};

// A consumer thread's scales of one slice: its two rows' and its 32 columns' (in pairs).
struct SliceScales {
  float a0, a1;
  float2 b[16];
};

// Read from shared memory while the slice's wgmma runs (so their latency is hidden).
template <class R>
__device__ inline SliceScales load_scales(const R& ring, int s, int i, int consumer) {
  const int th = threadIdx.x % 128;
  const float* sa = ring.a_scale(s, i) + 64 * consumer + frag_row(th, 0);
  const float4* sb = reinterpret_cast<const float4*>(ring.b_scale(s, i) + 36 * (th % 4));
  SliceScales out;
  out.a0 = sa[0];
  out.a1 = sa[8];
#pragma unroll
  for (int j = 0; j < 16; j += 2) {
    const float4 v = sb[j / 2];
    out.b[j] = make_float2(v.x, v.y);
    out.b[j + 1] = make_float2(v.z, v.w);
  }
  return out;
}

// acc += t * (row scale x column scale): the fragment's element 4 j + {0, 1} is in row a0's,
// 4 j + {2, 3} in row a1's, columns b[j].x and b[j].y.
__device__ inline void add_slice(float (&acc)[64], const float (&t)[64], const SliceScales& sc) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] = fmaf(t[4 * j + 0], sc.a0 * sc.b[j].x, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(t[4 * j + 1], sc.a0 * sc.b[j].y, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(t[4 * j + 2], sc.a1 * sc.b[j].x, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(t[4 * j + 3], sc.a1 * sc.b[j].y, acc[4 * j + 3]);
  }
}

// The ring (hopper::Pipeline's protocol) and its third barrier: `full` (the copy engine's bytes
// and the copying lanes' scale bytes: 1 + 32 arrivals), `empty` (a lane of each of the 8 consumer
// warps), `ready` (a converting warp's fp32 scales, one arrival), which the consumers wait for
// after `full`, in the same phases.
template <int kStagesT>
struct Fp8Pipeline {
  hopper::Pipeline<kStagesT> stages;
  std::uint64_t* ready;

  // The barriers made (thread 32), and the CTA synchronised.
  __device__ void init() const {
    if (threadIdx.x == 32) {
      stages.init(1 + 32, 8);
      for (int s = 0; s < kStagesT; ++s) hopper::mbar_init(&ready[s], 1);
      hopper::fence_barrier_init();
    }
    __syncthreads();
  }
  // A converting warp, once its lanes have written the stage's fp32 scales.
  __device__ void scales_ready(int stage, int lane) const {
    __syncwarp();
    if (lane == 0) hopper::mbar_arrive(&ready[stage]);
  }
  // Consumer: the stage at `pos` once its tiles, scale bytes and fp32 scales are in.
  __device__ int wait(const hopper::RingPos<kStagesT>& pos) const {
    stages.wait(pos);
    pos.wait_full(ready);  // (a second barrier of the same phases)
    return pos.stage;
  }
  // Consumer: the stage given back (a lane of each consumer warp, after the warp's lanes have
  // read its scales) and the ring advanced.
  __device__ void release(hopper::RingPos<kStagesT>& pos, int lane) const {
    __syncwarp();
    if (lane == 0) stages.release(pos.stage);
    pos.advance();
  }
};

// A converting warp's B scales of a stage: lane l turns slice l / 8's 16 bytes of B rows
// 16 (l % 8) .. into fp32 at their b_index places.
template <class R>
__device__ inline void convert_b_scales(const R& ring, int stage, int lane) {
  const uint4 rb = reinterpret_cast<const uint4*>(ring.raw_b(stage))[lane];
  const std::uint32_t bw[4] = {rb.x, rb.y, rb.z, rb.w};
  float* dst = ring.b_scale(stage, lane / 8);
#pragma unroll
  for (int c = 0; c < 16; c += 2) {  // B rows r, r + 1: adjacent in b_index order
    const int r = 16 * (lane % 8) + c;
    const auto f = [&](int e) {
      return scale_value(static_cast<std::uint8_t>(bw[e / 4] >> (8 * (e % 4))));
    };
    *reinterpret_cast<float2*>(dst + R::b_index(r)) = make_float2(f(c), f(c + 1));
  }
}

// A consumer warpgroup's work on one landed stage: each of its `slices` 32-deep slices one wgmma
// into the partial t (the slice's scales read meanwhile), then added to acc, scaled.
template <class R>
__device__ inline void consume_stage(const R& ring, int stage, int slices, int consumer,
                                     float (&acc)[64], float (&t)[64]) {
  const std::uint32_t a = hopper::smem_addr(ring.a(stage)) + consumer * 64 * 128;
  const std::uint32_t b = hopper::smem_addr(ring.b(stage));
#pragma unroll
  for (int i = 0; i < kSlices; ++i) {
    if (i < slices) {
      hopper::wgmma_fence();
      hopper::wgmma_e4m3_n128(t, hopper::smem_desc(a + 32 * i), hopper::smem_desc(b + 32 * i), 0);
      hopper::wgmma_commit();
      const SliceScales scales = load_scales(ring, stage, i, consumer);
      hopper::wgmma_wait<0>();
      hopper::fence_regs(t);
      add_slice(acc, t, scales);
    }
  }
}

// The persistent kernel. map_a: A's E4M3 rows (boxes 128 x 128 bytes); map_b0 / map_b1: the
// weights' E4M3 [El * N, K'] (boxes of 64 rows when paired, else 128). Epilogue:
// `void operator()(const Tile&, int consumer, const Accumulators&) const` on the consumer
// warpgroup's 128 threads.
// kProbe != 0: measurement variants of the consumer loop for benchmarks/probes (wrong results;
// no entry point uses them): 1 adds partials unscaled, 2 converts no scales (the converting
// warp only passes the stage on), 3 sums a stage's 4 slices in the tensor cores and scales
// once, 4 issues no wgmma, 5 copies no scale bytes (the copying warps only arrive), 6 is 5 with
// 2 and 3 (the BF16 kernel's pipeline, FP8 tiles), 7 and 8 start the second consumer 300 and
// 700 cycles late (so the two alternate between wgmma and adding: +4 %, not adopted).
template <BLoad kB, int kStagesT, class Epilogue, int kProbe = 0>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b0,
                            const __grid_constant__ CUtensorMap map_b1, Problem p, Scales sc,
                            Epilogue epilogue) {
  using R = Ring<kStagesT>;
  constexpr bool kPaired = kB == BLoad::kPaired;
  constexpr int kTileN = kPaired ? kBlockN / 2 : kBlockN;  // output columns per weight and tile
  extern __shared__ unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t full[kStagesT];   // tiles and scale bytes landed
  __shared__ alignas(8) std::uint64_t ready[kStagesT];  // fp32 scales written
  __shared__ alignas(8) std::uint64_t empty[kStagesT];  // the consumers are done with the stage
  __shared__ int prefix[kMaxExperts + 1];

  const R ring{hopper::swizzle_base(smem_raw)};
  const Fp8Pipeline<kStagesT> pipe{{full, empty}, ready};
  TileList list{prefix, 0};
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) list.build(p, kTileN, lane);
  list.n_tiles = (p.n + kTileN - 1) / kTileN;
  pipe.init();
  const int total = list.total(p);
  const int blocks = k_blocks(p);

  if (threadIdx.x < 128) {  // ---------------------------------------------- producer
    // Warp 0: a stage's tiles by the copy engine (one lane) and its scale bytes by asynchronous
    // copies (every lane: A's rows lane + 32 q, 4 bytes each; B's slice lane / 8, B rows
    // 16 (lane % 8).., 16 bytes). Warps 1-3 turn the landed bytes into fp32, a stage in three
    // each (one warp alone could not keep up: the conversion is a short dependent chain per
    // stage, and a warp converts one stage at a time).
    Fp8Regs::producer();  // the conversion needs more than a copying warp
    hopper::RingPos<kStagesT> pos;
    int n = 0;  // stages so far
    if (warp == 0 && lane == 0) {
      hopper::prefetch_tensor_map(&map_a);
      hopper::prefetch_tensor_map(&map_b0);
      if constexpr (kB != BLoad::kSingle) hopper::prefetch_tensor_map(&map_b1);
    }
    for (int t = blockIdx.x; t < total; t += gridDim.x) {
      const Tile tile = locate(p, list, t, kTileN);
      for (int kb = 0; kb < blocks; ++kb, ++n) {
        const KBlock k = k_block(p, kb);
        const int stage = pos.stage;
        if (warp == 0) {
          pipe.stages.acquire(pos);
          if (lane == 0) {
            pipe.stages.expect(stage, R::kStageBytes);
            hopper::tma_load_2d(ring.a(stage), &map_a, &full[stage], k.k0,
                                static_cast<int>(tile.row0));
            const int b_row = tile.expert * p.n + tile.col0;
            const CUtensorMap* map_b = k.weight == 0 ? &map_b0 : &map_b1;
            hopper::tma_load_2d(ring.b(stage), map_b, &full[stage], k.b_k0, b_row);
            if constexpr (kPaired) {
              hopper::tma_load_2d(ring.b(stage) + R::kBBytes / 2, &map_b1, &full[stage], k.k0,
                                  b_row);
            }
          }
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const std::int64_t row = tile.row0 + lane + 32 * q;
            if (row < p.num_rows && kProbe < 5) {
              hopper::cp_async_4(ring.raw_a(stage) + 4 * (lane + 32 * q),
                                 sc.a + row * sc.a_stride + k.k0 / kSliceK);
            }
          }
          const int i = lane / 8, g = lane % 8;
          const bool second = kPaired ? g >= 4 : k.weight == 1;
          const int col = tile.col0 + 16 * (kPaired ? g % 4 : g);
          if (i < k.slices && col < p.n && kProbe < 5) {
            const std::uint8_t* src = (second ? sc.b1 : sc.b0) +
                                      (static_cast<std::int64_t>(tile.expert) * (k.b_k / kSliceK) +
                                       k.b_k0 / kSliceK + i) *
                                          p.n +
                                      col;
            hopper::cp_async_16(ring.raw_b(stage) + kBlockN * i + 16 * g, src);
          }
          hopper::cp_async_arrive(&full[stage]);
        } else if (n % 3 == warp - 1) {
          pipe.stages.wait(pos);
          if constexpr (kProbe != 2 && kProbe != 6) {
            const uint4 ra = reinterpret_cast<const uint4*>(ring.raw_a(stage))[lane];
            const std::uint32_t aw[4] = {ra.x, ra.y, ra.z, ra.w};  // rows 4 lane + r, 4 slices
#pragma unroll
            for (int r = 0; r < 4; ++r) {
#pragma unroll
              for (int s = 0; s < kSlices; ++s) {
                ring.a_scale(stage, s)[4 * lane + r] =
                    scale_value(static_cast<std::uint8_t>(aw[r] >> (8 * s)));
              }
            }
            convert_b_scales(ring, stage, lane);
          }
          pipe.scales_ready(stage, lane);
        }
        pos.advance();
      }
    }
    return;
  }

  // ------------------------------------------------------------------------ consumers
  // Each slice: one wgmma into the partial t, the slice's scales read meanwhile, wait for it,
  // add it. The two consumer warpgroups
  // interleave, so the tensor cores run one's wgmma while the other adds. (A second partial,
  // to overlap within a warpgroup, does not fit: 384 threads leave 168 registers, and ptxas
  // serialises wgmmas whose neighbours' results are read meanwhile.) A stage is given back after
  // its last slice is added, by a lane of each consumer warp.
  Fp8Regs::consumer();
  const int consumer = threadIdx.x / 128 - 1;  // 0 or 1: rows [64 c, 64 c + 64) of the tile
  hopper::RingPos<kStagesT> pos;
  Accumulators acc;
  float t[64];
  if constexpr (kProbe == 7 || kProbe == 8) {
    if (consumer == 1) {
      const long long start = clock64();
      while (clock64() - start < (kProbe == 7 ? 300 : 700)) {
      }
    }
  }
  for (int tt = blockIdx.x; tt < total; tt += gridDim.x) {
    const Tile tile = locate(p, list, tt, kTileN);
#pragma unroll
    for (int q = 0; q < 64; ++q) acc.d[q] = 0.0f;
    for (int kb = 0; kb < blocks; ++kb) {
      const int slices = k_block(p, kb).slices;
      const int stage = pipe.wait(pos);
      const std::uint32_t a = hopper::smem_addr(ring.a(stage)) + consumer * 64 * 128;
      const std::uint32_t b = hopper::smem_addr(ring.b(stage));
      if constexpr (kProbe == 3 || kProbe == 6) {
        hopper::wgmma_fence();
#pragma unroll
        for (int i = 0; i < kSlices; ++i) {
          if (i < slices) {
            hopper::wgmma_e4m3_n128(t, hopper::smem_desc(a + 32 * i), hopper::smem_desc(b + 32 * i),
                                    i);
          }
        }
        hopper::wgmma_commit();
        const SliceScales scales = load_scales(ring, stage, 0, consumer);
        hopper::wgmma_wait<0>();
        hopper::fence_regs(t);
        add_slice(acc.d, t, scales);
      } else if constexpr (kProbe == 1 || kProbe == 4) {
#pragma unroll
        for (int i = 0; i < kSlices; ++i) {
          if (i < slices) {
            if constexpr (kProbe != 4) {
              hopper::wgmma_fence();
              hopper::wgmma_e4m3_n128(t, hopper::smem_desc(a + 32 * i),
                                      hopper::smem_desc(b + 32 * i), 0);
              hopper::wgmma_commit();
            }
            const SliceScales scales = load_scales(ring, stage, i, consumer);
            if constexpr (kProbe != 4) hopper::wgmma_wait<0>();
            hopper::fence_regs(t);
            if constexpr (kProbe == 1) {
#pragma unroll
              for (int q = 0; q < 64; ++q) acc.d[q] += t[q] + 0.0f * scales.a0;
            } else {
              add_slice(acc.d, t, scales);
            }
          }
        }
      } else {
        (void)a;
        (void)b;
        consume_stage(ring, stage, slices, consumer, acc.d, t);
      }
      pipe.release(pos, lane);
    }
    epilogue(tile, consumer, acc);
  }
}

}  // namespace mok::mxfp8::gemm
