// Hopper (sm_90a) building blocks of the expert GEMMs of mok-bf16 and mok-mxfp8: mbarriers, bulk
// tensor copies (TMA), wgmma on bf16 and e4m3 operands in 128-byte-swizzled shared memory, and
// tensor maps made on the host. CUDA code: include it from .cu files only.
//
// Every tile the GEMMs stage is made of boxes of 64 rows of 128 bytes (64 bf16 or 128 e4m3),
// written by the
// copy engine with the 128-byte swizzle. A K-major tile (K along the 128-byte rows) needs only
// the tile's address (1024 byte aligned), the stride between 8-row groups (1024 bytes) and the
// swizzle mode; its k-th 16-wide slice starts 32 bytes further (the swizzle is applied to the
// absolute address bits, so a plain offset selects it). An MN-major tile (M or N along the
// rows, K down them: weights used untransposed, and both operands of a weight gradient) is
// boxes of 64 k-rows x 64 columns, 8 KiB apart; its k-th 16-deep slice starts 16 rows (2048
// bytes) further, and wgmma reads it with the operand's transpose bit set.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace mok::hopper {

// ------------------------------------------------------------------ shared memory and barriers

__device__ inline std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ inline void mbar_init(std::uint64_t* bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes the barriers' initialisation visible to the copy engine.
__device__ inline void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ inline void mbar_expect_tx(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ inline void mbar_arrive(std::uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Waits until the barrier's phase with parity `parity` has completed.
__device__ inline void mbar_wait(std::uint64_t* bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// A 2-D box of a tensor map into shared memory, completing on `bar` (coordinates: column, row).
__device__ inline void tma_load_2d(void* dst, const CUtensorMap* map, std::uint64_t* bar, int col,
                                   int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(row)
      : "memory");
}

// The copy engine stores a box of `map` at (col, row) from shared memory at `src` (the map's
// swizzle), as one bulk group of this thread's once committed (bulk_commit). Before `src` is
// written again the thread waits for the group's reads (bulk_wait_read); before the stores are
// relied on in this kernel, for the group itself (bulk_wait). Shared memory written by the
// generic proxy (threads, cp.async) needs fence_proxy_async between those writes and the store.
__device__ inline void tma_store_2d(const CUtensorMap* map, const void* src, int col, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(smem_addr(src)), "r"(col), "r"(row)
               : "memory");
}
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int kPending>
__device__ inline void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ inline void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// ------------------------------------------------------------------ thread-block clusters
//
// A kernel launched in clusters of CTAs (cudaLaunchAttributeClusterDimension) can have the copy
// engine write one box into the shared memory of several of them at once (multicast: the same
// offset in each, each CTA's barrier at the same offset completing its share of the bytes), and
// arrive on a barrier of another CTA of its cluster.

// This CTA's rank in its cluster.
__device__ inline std::uint32_t cluster_rank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster meets here (release / acquire: what one CTA wrote to
// its shared memory, its barriers' initialisation included, is visible to the others after it).
__device__ inline void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::
          : "memory");
}

// An arrival on the barrier at `bar`'s offset in the shared memory of cluster CTA `cta`.
__device__ inline void mbar_arrive_cluster(std::uint64_t* bar, std::uint32_t cta) {
  std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_addr(bar)), "r"(cta));
  // Release at the CTA's scope (the default), as a local arrival: the arriving thread's own reads
  // of the stage are complete (wgmma waited for), and a release at the cluster's scope would make
  // it wait for its earlier global stores to land first (the deferred epilogue's: measured,
  // session 15, the weight-gradient GEMM ~60 % slower).
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// tma_load_2d into the CTAs of `cta_mask` (bit i: cluster rank i), at dst's offset in each; the
// bytes complete on the barrier at bar's offset in each.
__device__ inline void tma_load_2d_multicast(void* dst, const CUtensorMap* map, std::uint64_t* bar,
                                             int col, int row, std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(row),
      "h"(cta_mask)
      : "memory");
}

// Plain asynchronous copies (not the copy engine) of 4 or 16 bytes, global to shared, and an
// arrival on `bar` once this thread's earlier ones have landed. The barrier's expected count
// includes that arrival (.noinc).
__device__ inline void cp_async_4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

__device__ inline void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

__device__ inline void cp_async_arrive(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

// cp_async_16 reading `src_bytes` (16 or 0) bytes and zero-filling the rest: a row gather's
// padding rows cost no load (src must still be a valid address).
__device__ inline void cp_async_16_zfill(void* dst, const void* src, std::uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// Closes this thread's group of asynchronous copies issued since the last commit.
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Adds `bytes` to the barrier's expected transaction count without an arrival (the thread that
// issues a stage's copies arrives separately, like every other thread of its stage).
__device__ inline void mbar_expect_tx_only(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ inline void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}

// ------------------------------------------------------------------ registers per warpgroup

template <int kRegs>
__device__ inline void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <int kRegs>
__device__ inline void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// The registers of a warp-specialized CTA (one producer warpgroup, kConsumers consumer
// warpgroups, __launch_bounds__(128 (1 + kConsumers), 1)): ptxas gives each thread 65536 / threads
// rounded down to 8 (168 at 384 threads), so the CTA's pool is that times its threads, and
// setmaxnreg only moves registers between its warpgroups. An increase the pool cannot cover
// waits for ever (a hang, not an error): the split is checked here, where every kernel takes it.
template <int kProducerRegs, int kConsumerRegs, int kConsumers = 2>
struct RegisterSplit {
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kPool = (65536 / kThreads) / 8 * 8 * kThreads;
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0,
                "setmaxnreg takes multiples of 8");
  static_assert(kProducerRegs >= 24 && kConsumerRegs <= 256, "setmaxnreg's range is 24..256");
  static_assert(
      128 * (kProducerRegs + kConsumers * kConsumerRegs) <= kPool,
      "the warpgroups' registers exceed the CTA's pool: the consumers' increase would hang");
  __device__ static void producer() { regs_dealloc<kProducerRegs>(); }
  __device__ static void consumer() { regs_alloc<kConsumerRegs>(); }
};

// ------------------------------------------------------------------ wgmma

// The descriptor of a K-major, 128-byte-swizzled bf16 tile at shared address `addr`.
__device__ inline std::uint64_t smem_desc(std::uint32_t addr) {
  constexpr std::uint64_t kStride8Rows = 1024;  // bytes between consecutive 8-row groups
  std::uint64_t d = 0;
  d |= static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<std::uint64_t>(1) << 16;  // leading byte offset: unused with this swizzle
  d |= (kStride8Rows >> 4) << 32;
  d |= static_cast<std::uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

// The descriptor of an MN-major, 128-byte-swizzled bf16 tile at `addr`: boxes of 64 k-rows x 64
// columns, the next 64 columns 8 KiB further (leading byte offset), the next 8 k-rows 1024
// bytes further (stride byte offset).
__device__ inline std::uint64_t smem_desc_mn(std::uint32_t addr) {
  constexpr std::uint64_t kBoxBytes = 64 * 128;
  constexpr std::uint64_t kStride8Rows = 1024;
  std::uint64_t d = 0;
  d |= static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4);
  d |= (kBoxBytes >> 4) << 16;
  d |= (kStride8Rows >> 4) << 32;
  d |= static_cast<std::uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

// Orders this thread's plain shared-memory writes before later reads by wgmma or the copy
// engine (the async proxy).
__device__ inline void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ inline void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ inline void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ inline void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma boundary.
template <int kN>
__device__ inline void fence_regs(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x N] (+)= A[64 x 16] * B[N x 16]^T, bf16 operands from shared memory, fp32 accumulators;
// `accumulate` 0 overwrites D; kTransA / kTransB: the operand's tile is MN-major (smem_desc_mn)
// instead of K-major. The fragment: thread t of the warpgroup holds, for the n8 block
// j, d[4j + {0,1}] at row 16 (t / 32) + (t % 32) / 4 and columns 8 j + 2 (t % 4) + {0,1}, and
// d[4j + {2,3}] eight rows below.
template <int kN>
struct Wgmma;

#define MOK_WGMMA_ARGS8(i)                                                                        \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])

template <>
struct Wgmma<128> {
  template <int kTransA = 0, int kTransB = 0>
  __device__ static void mma(float (&d)[64], std::uint64_t a, std::uint64_t b, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n"
        "}\n"
        : MOK_WGMMA_ARGS8(0), MOK_WGMMA_ARGS8(8), MOK_WGMMA_ARGS8(16), MOK_WGMMA_ARGS8(24),
          MOK_WGMMA_ARGS8(32), MOK_WGMMA_ARGS8(40), MOK_WGMMA_ARGS8(48), MOK_WGMMA_ARGS8(56)
        : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
  }
};

template <>
struct Wgmma<256> {
  template <int kTransA = 0, int kTransB = 0>
  __device__ static void mma(float (&d)[128], std::uint64_t a, std::uint64_t b, int accumulate) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, "
        "%111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, "
        "%125, %126, %127}, "
        "%128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        : MOK_WGMMA_ARGS8(0), MOK_WGMMA_ARGS8(8), MOK_WGMMA_ARGS8(16), MOK_WGMMA_ARGS8(24),
          MOK_WGMMA_ARGS8(32), MOK_WGMMA_ARGS8(40), MOK_WGMMA_ARGS8(48), MOK_WGMMA_ARGS8(56),
          MOK_WGMMA_ARGS8(64), MOK_WGMMA_ARGS8(72), MOK_WGMMA_ARGS8(80), MOK_WGMMA_ARGS8(88),
          MOK_WGMMA_ARGS8(96), MOK_WGMMA_ARGS8(104), MOK_WGMMA_ARGS8(112), MOK_WGMMA_ARGS8(120)
        : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
  }
};

// D[64 x 128] (+)= A[64 x 32] * B[128 x 32]^T on e4m3 operands, both K-major (FP8 wgmma has no
// transpose), fp32 accumulators, the fragment of Wgmma<128>. In the 128-byte-swizzled tiles a
// 32-deep k slice of e4m3 is 32 bytes, as a 16-deep one of bf16: the same descriptors serve.
__device__ inline void wgmma_e4m3_n128(float (&d)[64], std::uint64_t a, std::uint64_t b,
                                       int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : MOK_WGMMA_ARGS8(0), MOK_WGMMA_ARGS8(8), MOK_WGMMA_ARGS8(16), MOK_WGMMA_ARGS8(24),
        MOK_WGMMA_ARGS8(32), MOK_WGMMA_ARGS8(40), MOK_WGMMA_ARGS8(48), MOK_WGMMA_ARGS8(56)
      : "l"(a), "l"(b), "r"(accumulate));
}

#undef MOK_WGMMA_ARGS8

// ------------------------------------------------------------------ tensor maps (host)

// The element types of the tensor maps.
enum class MapType { kBf16, kU8 };

// A row-major matrix [rows, cols] of `type` (cols contiguous; 128-byte rows of the box: 64 bf16
// or 128 bytes) as a tensor map whose boxes are [box_rows, 128 bytes] with the 128-byte swizzle;
// rows and columns past the end read as zeros. row_bytes: the stride between rows (0: dense);
// the copy engine needs it and the base 16-byte aligned.
inline CUtensorMap make_tensor_map(const void* base, std::uint64_t rows, std::uint64_t cols,
                                   std::uint32_t box_rows, MapType type = MapType::kBf16,
                                   std::uint64_t row_bytes = 0) {
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                             cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw std::runtime_error("mok: the CUDA driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<Encode>(fn);
  }();
  const std::uint64_t element_bytes = type == MapType::kBf16 ? 2 : 1;
  CUtensorMap map;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes != 0 ? row_bytes : cols * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(
      &map,
      type == MapType::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error("mok: cuTensorMapEncodeTiled failed (error " +
                             std::to_string(static_cast<int>(r)) + ") for a [" +
                             std::to_string(rows) + ", " + std::to_string(cols) + "] matrix");
  }
  return map;
}

}  // namespace mok::hopper
