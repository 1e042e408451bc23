// The pipeline of every warp-specialized GEMM kernel of mok on sm_90a: mok-bf16's grouped GEMM,
// weight-gradient GEMM and forward megakernel, mok-mxfp8's grouped and weight-gradient GEMMs.
// CUDA code: include it from .cu files only.
//
// Each of those kernels is one CTA per SM, persistent, 384 threads: a producer warpgroup fills a
// ring of kStages shared-memory stages with the operands of one k-block each, two consumer
// warpgroups (64 rows of a 128-row tile each) read them with wgmma. Pipeline<kStages> is the ring's
// protocol, the one every such kernel runs:
//
//   producer   stage = acquire(pos)          waits until the stage's readers gave it back
//              (copy engine bytes announced on full[stage], loads issued, arrivals)
//              pos.advance()
//   consumer   stage = wait(pos)             waits until full[stage] completed
//              (wgmmas on the stage)
//              release(stage)                one arrival on empty[stage]
//              pos.advance()
//
// full[s] completes when its fill arrivals (init's `fill_arrivals`: one thread driving the copy
// engine, or every thread of a producer that copies rows itself) and the copy engine's announced
// bytes are in; empty[s] when its `read_arrivals` (one per consumer warpgroup, or per consumer
// warp, of every CTA that reads the stage) are. A fresh barrier counts its phase of parity 1 as
// done, so the producer's first pass over the ring waits for nothing. The kernels differ in what
// fills a stage (the copy engine, gathering threads, block-scale copies) and in what the consumers
// do between wait and release; the walk over a CTA's tiles and the consumer's tile loop are the
// kernels' own headers' (mok-bf16 grouped_gemm.cuh: consume_tile).
#pragma once

#include <cstdint>

#include "mok/core/hopper.cuh"

namespace mok::hopper {

// A kernel's dynamic shared memory from its first 1024-byte boundary: the 128-byte swizzle's tiles
// start at multiples of 1024 bytes (a kernel asks for 1024 bytes more than its ring).
__device__ inline unsigned char* swizzle_base(unsigned char* raw) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) &
                                          ~std::uintptr_t{1023});
}

// A position in a ring of kStages stages: the stage and the parity of the phase its barriers are
// in. The producer and every consumer walk the ring with one each.
template <int kStages>
struct RingPos {
  int stage = 0;
  std::uint32_t phase = 0;

  __device__ void wait_empty(std::uint64_t* empty) const { mbar_wait(&empty[stage], phase ^ 1); }
  __device__ void wait_full(std::uint64_t* full) const { mbar_wait(&full[stage], phase); }
  __device__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The ring's barriers (kStages each, in the kernel's static shared memory) and the protocol above.
template <int kStages>
struct Pipeline {
  std::uint64_t* full;   // the stage's operands have landed
  std::uint64_t* empty;  // the stage's readers are done with it

  // By one thread, before the CTA (or cluster) synchronises; the kernel's other barriers beside
  // it, then one fence_barrier_init.
  __device__ void init(std::uint32_t fill_arrivals, std::uint32_t read_arrivals) const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], fill_arrivals);
      mbar_init(&empty[s], read_arrivals);
    }
  }
  // Producer: the stage at `pos`, once its readers have given it back.
  __device__ int acquire(const RingPos<kStages>& pos) const {
    pos.wait_empty(empty);
    return pos.stage;
  }
  // Producer, the thread that drives the copy engine: its arrival, and `bytes` more to land.
  __device__ void expect(int stage, std::uint32_t bytes) const {
    mbar_expect_tx(&full[stage], bytes);
  }
  // Consumer: the stage at `pos`, once it is full.
  __device__ int wait(const RingPos<kStages>& pos) const {
    pos.wait_full(full);
    return pos.stage;
  }
  // Consumer: one of the stage's read arrivals (kCluster > 1: on the barrier of every CTA of the
  // cluster, whose producers multicast into the stage).
  template <int kCluster = 1>
  __device__ void release(int stage) const {
    if constexpr (kCluster > 1) {
#pragma unroll
      for (int cta = 0; cta < kCluster; ++cta) mbar_arrive_cluster(&empty[stage], cta);
    } else {
      mbar_arrive(&empty[stage]);
    }
  }
};

}  // namespace mok::hopper
