// The CUDA transport: row pull/push kernels over peer pointers of symmetric memory (NVLink P2P,
// plain global loads and stores; never multicast/NVLS) and the epoch barrier kernel. Launches
// only: nothing here allocates device memory, reads device memory on the host or synchronizes, so
// every launch can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "mok/core/transport.h"
#include "transport.h"

namespace mok::core {
namespace {

using transport::DeviceSync;
using transport::PullRows;
using transport::PushRows;
using transport::ZeroRows;

// Row movers: 24 warps per CTA, one row per warp at a time, each lane with 8 16-byte loads in
// flight: 96 KiB in flight per CTA (80 registers a thread, none spilled). Measured over NVLink on
// the H200 pair (NOTES.md, session 5): 16 KiB in flight (8 warps x 4) moved ~9 GB/s per CTA,
// 64 KiB ~20, 96 KiB ~23: close to what one SM moves over NVLink by any means we tried (the copy
// engine's bulk copies included).
constexpr int kCopyThreads = 768;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr int kCopyUnroll = 8;
// The barrier: one CTA, one thread per peer (a loop beyond 1024 peers).
constexpr int kBarrierMaxThreads = 1024;

// pull_rows_kernel: grid = num_workers CTAs (the "communication SMs"), persistent: global warp w
// of W takes table rows w, w + W, w + 2W, ... For each row the warp reads the row's source rank
// and route (one broadcast load each), then either copies row_bytes from the source rank's buffer
// (a peer's symmetric memory, or local) into the table row, or zero-fills it (padding). No
// synchronization inside: rows are independent, and the barrier kernel that precedes or follows
// on the stream orders them against the peers.
__global__ void __launch_bounds__(kCopyThreads, 1) pull_rows_kernel(PullRows move) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32;
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kCopyWarps;
  for (std::int64_t i = warp; i < move.capacity; i += num_warps) {
    const unsigned char* src = move.src_row(i);
    if (src != nullptr) {
      transport::warp_copy_row<kCopyUnroll>(move.dst_row(i), src, move.row_bytes, lane);
    } else {
      transport::warp_zero_row(move.dst_row(i), move.row_bytes, lane);
    }
  }
}

// push_rows_kernel: the same grid and row striping as the pull; each warp copies its local table
// row into the destination rank's buffer at the row's route (one row per route, so no two warps
// of any rank write the same bytes). Padding rows are skipped.
__global__ void __launch_bounds__(kCopyThreads, 1) push_rows_kernel(PushRows move) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32;
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kCopyWarps;
  for (std::int64_t i = warp; i < move.capacity; i += num_warps) {
    unsigned char* dst = move.dst_row(i);
    if (dst != nullptr) {
      transport::warp_copy_row<kCopyUnroll>(dst, move.src_row(i), move.row_bytes, lane);
    }
  }
}

// zero_rows_kernel: the same striping; a warp zero-fills its row when it is padding.
__global__ void __launch_bounds__(kCopyThreads, 1) zero_rows_kernel(ZeroRows rows) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32;
  const std::int64_t num_warps = static_cast<std::int64_t>(gridDim.x) * kCopyWarps;
  for (std::int64_t i = warp; i < rows.capacity; i += num_warps) {
    if (rows.padding(i)) transport::warp_zero_row(rows.dst_row(i), rows.row_bytes, lane);
  }
}

// epoch_barrier_kernel: one CTA; thread p serves peer p (p, p + blockDim.x, ...).
//   1. thread 0 bumps the local epoch (device memory, so graph replays keep counting) and reads
//      the sticky error code; both are broadcast through shared memory.
//   2. every thread: fence, then a release store of the epoch into this rank's slot of its peers'
//      pads (its own pad included).
//   3. unless the error was already set, every thread spins (acquire loads) on its peers' slots
//      of the local pad until they reach the epoch or %globaltimer says timeout_ns have passed,
//      and checks each peer's tag (transport.h); the lowest peer late or out of step is kept
//      (atomicMin in shared memory), and the thread that found it keeps why.
//   4. thread 0 writes the error words for that peer, the code last (release), and every thread
//      fences so the kernels after the barrier see the peers' data.
// Nothing ever waits without a deadline, so a missing peer costs timeout_ns, never a hang.
__global__ void __launch_bounds__(kBarrierMaxThreads)
    epoch_barrier_kernel(std::uint64_t* epoch, const std::int64_t* signal_pad_ptrs, int rank,
                         int world_size, std::int32_t* error, int stage, std::int64_t timeout_ns) {
  __shared__ std::uint64_t s_epoch;
  __shared__ int s_error_set;
  __shared__ int s_late_peer;
  __shared__ int s_code;
  if (threadIdx.x == 0) {
    const std::uint64_t e = *epoch + 1;
    *epoch = e;
    s_epoch = e;
    s_error_set = DeviceSync::load_acquire(error + transport::kErrorCode) != 0;
    s_late_peer = world_size;
  }
  __syncthreads();
  const std::uint64_t e = s_epoch;
  const int first = static_cast<int>(threadIdx.x);
  const int step = static_cast<int>(blockDim.x);

  // fence.sc.sys: every write this rank made before the barrier (earlier kernels on the stream,
  // including their stores into peers' buffers) -> the epoch stores below. The release stores
  // alone order only what this thread has observed.
  __threadfence_system();
  const auto tag = static_cast<std::uint32_t>(stage);
  transport::barrier_arrive<DeviceSync>(signal_pad_ptrs, rank, world_size, e, tag, first, step);

  transport::BarrierMiss miss{-1, 0};
  if (!s_error_set) {
    miss = transport::barrier_wait<DeviceSync>(signal_pad_ptrs, rank, world_size, e, tag,
                                               timeout_ns, first, step);
    if (miss.peer >= 0) atomicMin(&s_late_peer, miss.peer);
  }
  __syncthreads();
  if (miss.peer >= 0 && miss.peer == s_late_peer) s_code = miss.code;  // one thread: one peer
  __syncthreads();
  if (threadIdx.x == 0 && s_late_peer < world_size) {
    transport::record_error<DeviceSync>(error, s_code, s_late_peer, stage, rank);
  }
  // fence.sc.sys: the acquire loads above -> this rank's reads of peer data in the kernels that
  // follow on the stream (a kernel boundary is not a system-scope fence by itself).
  __threadfence_system();
}

void check_launch(const char* fn) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(fn) + ": CUDA kernel launch failed: " +
                             cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

cudaStream_t as_stream(std::int64_t stream) {
  return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(stream));
}

// No more CTAs than there are warps' worth of rows: an idle CTA still costs a launch slot.
int copy_grid(std::int64_t capacity, int num_workers) {
  const std::int64_t needed = (capacity + kCopyWarps - 1) / kCopyWarps;
  return static_cast<int>(needed < num_workers ? needed : num_workers);
}

}  // namespace

// Every launch goes to the current device, which must be the stream's (mok-torch makes the
// workspace's device current). No device or stream queries here: cudaStreamGetDevice, for one,
// is refused while the stream is being captured into a CUDA graph.

void pull_rows_cuda(const PullRows& move, int num_workers, std::int64_t stream) {
  pull_rows_kernel<<<copy_grid(move.capacity, num_workers), kCopyThreads, 0, as_stream(stream)>>>(
      move);
  check_launch("pull_rows");
}

void push_rows_cuda(const PushRows& move, int num_workers, std::int64_t stream) {
  push_rows_kernel<<<copy_grid(move.capacity, num_workers), kCopyThreads, 0, as_stream(stream)>>>(
      move);
  check_launch("push_rows");
}

void zero_rows_cuda(const ZeroRows& rows, int num_workers, std::int64_t stream) {
  zero_rows_kernel<<<copy_grid(rows.capacity, num_workers), kCopyThreads, 0, as_stream(stream)>>>(
      rows);
  check_launch("zero_rows");
}

void barrier_cuda(std::uint64_t* epoch, const std::int64_t* signal_pad_ptrs, int rank,
                  int world_size, std::int32_t* error, int stage, std::int64_t timeout_ns,
                  std::int64_t stream) {
  const std::int64_t warps = (static_cast<std::int64_t>(world_size) + 31) / 32;
  const int threads =
      warps * 32 < kBarrierMaxThreads ? static_cast<int>(warps * 32) : kBarrierMaxThreads;
  epoch_barrier_kernel<<<1, threads, 0, as_stream(stream)>>>(epoch, signal_pad_ptrs, rank,
                                                             world_size, error, stage, timeout_ns);
  check_launch("barrier");
}

namespace {
void check_mirror(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // a non-sticky error is not left for a later call to find
    throw std::runtime_error(std::string("ErrorMirror: ") + what + " failed: " +
                             cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}
}  // namespace

void mirror_create_cuda(std::int32_t** host, std::int64_t* device_address) {
  void* words = nullptr;
  check_mirror(cudaHostAlloc(&words, transport::kErrorWords * sizeof(std::int32_t),
                             cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc");
  void* on_device = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&on_device, words, 0);
  if (status != cudaSuccess) cudaFreeHost(words);
  check_mirror(status, "cudaHostGetDevicePointer");
  std::memset(words, 0, transport::kErrorWords * sizeof(std::int32_t));
  *host = static_cast<std::int32_t*>(words);
  *device_address = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(on_device));
}

void mirror_destroy_cuda(std::int32_t* host) noexcept {
  // (cudaFreeHost waits for the device's work, so no copy lands in freed memory)
  if (host != nullptr) cudaFreeHost(host);
  cudaGetLastError();  // (at exit the context may be gone: nothing to report from a destructor)
}

void mirror_publish_cuda(std::int64_t device_address, const std::int32_t* error,
                         std::int64_t stream) {
  check_mirror(cudaMemcpyAsync(reinterpret_cast<void*>(static_cast<std::uintptr_t>(device_address)),
                               error, transport::kErrorWords * sizeof(std::int32_t),
                               cudaMemcpyDefault, as_stream(stream)),
               "cudaMemcpyAsync");
}

}  // namespace mok::core
