// The device task queue of mok's persistent megakernels (docs/megakernel.md): a ticket counter
// that hands out tasks in a fixed order, per-task-group dependency counters, and waits on them
// that end in the transport's error words instead of hanging. CUDA code: include it from .cu
// files only.
//
// A megakernel's tasks are numbered so that every task depends only on tasks with smaller
// numbers. A CTA takes the next number from `Queue::head` (an integer atomic: it decides who runs
// a task, never how, so nothing here can change a bit of the results) and waits for the counters
// its task depends on. A task is only ever taken by a CTA that is running, and everything it waits
// for was taken earlier by a running CTA, so the waits cannot deadlock even when not every CTA of
// the grid is resident (another kernel may hold some SMs).
//
// The queue and the counters are zero when a launch starts; the launch's last CTA to finish sets
// them back to zero (reset_after_last_cta), so consecutive launches on a stream, and replays of a
// CUDA graph, need no fill kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "mok/core/transport.h"

namespace mok::tasks {

struct Queue {
  unsigned int head;    // next ticket
  unsigned int exited;  // CTAs of this launch that have finished
};

// ------------------------------------------------------------------ memory operations (GPU scope)

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Release: every write the CTA made before the barrier that precedes this (bar.sync orders the
// CTA's threads; release is cumulative) -> the acquire of a CTA that sees the new count.
__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Orders this thread's generic-proxy accesses of global memory with its async-proxy ones (the
// copy engine's loads): on the writing side after plain stores that a tensor copy will read, on
// the reading side between the acquire and the copy.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ unsigned int take_ticket(Queue* q) { return atomicAdd(&q->head, 1u); }

// ------------------------------------------------------------------ waits

// What a wait that gave up reports in the transport's error words (transport.h): the stage, and
// this rank as the one waited for (the dependency is on this GPU).
struct WaitSite {
  std::int32_t* error;  // int32 [transport::kErrorWords]
  std::int32_t stage;
  std::int32_t rank;
  std::int64_t timeout_ns;
};

// Spins until *counter >= target (acquire). Past `site.timeout_ns` it records the timeout (the
// first waiter to give up writes the words, the code last) and returns false: the caller goes on
// with whatever the memory holds, the launch ends, and the host raises the error.
__device__ inline bool wait_at_least(const int* counter, int target, const WaitSite& site) {
  if (load_acquire(counter) >= target) return true;
  using Sync = core::transport::DeviceSync;
  const std::int64_t start = Sync::now_ns();
  for (unsigned int spins = 0;; ++spins) {
    if (load_acquire(counter) >= target) return true;
    if ((spins & 63) == 63 && Sync::now_ns() - start > site.timeout_ns) break;
    __nanosleep(spins < 64 ? 20 : 200);
  }
  using core::transport::kErrorCode;
  // -1 claims the words while they are written; the host reads them only after the launch.
  if (atomicCAS(site.error + kErrorCode, 0, -1) == 0) {
    Sync::store_relaxed(site.error + core::transport::kErrorPeer, site.rank);
    Sync::store_relaxed(site.error + core::transport::kErrorStage, site.stage);
    Sync::store_relaxed(site.error + core::transport::kErrorRank, site.rank);
    Sync::store_release(site.error + kErrorCode, core::transport::kErrorTimeout);
  }
  return false;
}

// ------------------------------------------------------------------ end of a launch

// Called by the `threads` threads [first, first + threads) of every CTA once the CTA has finished
// all its tasks (the CTA's other threads touch neither the queue nor the counters any more):
// the last CTA to arrive zeroes counters[0, num_counters) and the queue for the next launch
// (every other CTA has stopped touching them). `barrier_id` names a free hardware barrier.
__device__ inline void reset_after_last_cta(Queue* q, int* counters, int num_counters, int first,
                                            int threads, int barrier_id) {
  __shared__ int last;
  const int me = static_cast<int>(threadIdx.x) - first;
  asm volatile("bar.sync %0, %1;" ::"r"(barrier_id), "r"(threads) : "memory");
  if (me == 0) {
    __threadfence();  // this CTA's counter updates -> before its arrival
    last = atomicAdd(&q->exited, 1u) == gridDim.x - 1;
  }
  asm volatile("bar.sync %0, %1;" ::"r"(barrier_id), "r"(threads) : "memory");
  if (!last) return;
  __threadfence();  // the other CTAs' arrivals -> before the zeroing
  for (int i = me; i < num_counters; i += threads) counters[i] = 0;
  if (me == 0) {
    q->head = 0;
    q->exited = 0;
  }
}

}  // namespace mok::tasks
