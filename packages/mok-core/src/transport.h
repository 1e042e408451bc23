// The transport's host API (docs/core-runtime.md, "Transport"): row pull/push and the epoch
// barrier, on the CPU (src/transport.cpp) or the GPU (cuda/transport.cu). Pointers are raw
// addresses; every function validates its scalars and throws std::invalid_argument naming the
// argument, std::runtime_error for a CUDA call on a build without CUDA or a failed launch.
#pragma once

#include <cstdint>
#include <string>

#include "mok/core/transport.h"

namespace mok::core {

enum class TransportDevice { kCpu, kCuda };

// "cpu" or "cuda"; throws std::invalid_argument naming `device` otherwise.
TransportDevice parse_transport_device(const std::string& device);

// For each table row i < capacity: copy row_bytes from
// src_ptrs[row_src_rank[i]] + (row_route[i] / route_divisor) * src_stride to dst + i * dst_stride,
// or zero-fill that destination row when row_src_rank[i] < 0.
void pull_rows(TransportDevice device, std::int64_t dst, std::int64_t src_ptrs,
               std::int64_t row_src_rank, std::int64_t row_route, std::int64_t capacity,
               std::int64_t route_divisor, std::int64_t row_bytes, std::int64_t src_stride,
               std::int64_t dst_stride, std::int64_t num_workers, std::int64_t stream);

// For each real table row i: copy row_bytes from src + (i / src_divisor) * src_stride to
// dst_ptrs[row_src_rank[i]] + row_route[i] * dst_stride, or with dst_local (dst_ptrs 0) to
// dst_local + row_route[i] * dst_stride for the rows of rank 0 (the others skipped).
void push_rows(TransportDevice device, std::int64_t src, std::int64_t dst_ptrs,
               std::int64_t row_src_rank, std::int64_t row_route, std::int64_t capacity,
               std::int64_t row_bytes, std::int64_t src_stride, std::int64_t dst_stride,
               std::int64_t num_workers, std::int64_t stream, std::int64_t src_divisor = 1,
               std::int64_t dst_local = 0);

// For each padding row i (row_src_rank[i] < 0): zero row_bytes at dst + i * dst_stride.
void zero_rows(TransportDevice device, std::int64_t dst, std::int64_t row_src_rank,
               std::int64_t capacity, std::int64_t row_bytes, std::int64_t dst_stride,
               std::int64_t num_workers, std::int64_t stream);

// The epoch barrier. On the CPU it blocks and returns false when the error words are (or get)
// set; on the GPU it enqueues one kernel on `stream` and returns true (the outcome lands in
// `error`, which the caller reads at its next check).
bool barrier(TransportDevice device, std::int64_t epoch, std::int64_t signal_pad_ptrs,
             std::int64_t rank, std::int64_t world_size, std::int64_t error, std::int64_t stage,
             std::int64_t timeout_ns, std::int64_t stream);

// The transport's error words as the host sees them (docs/core-runtime.md, "Ranks that agree"):
// four words of host memory that a call's last step copies the device's words into, behind the
// call's work, for the host to read at any time with no copy or event of its own. On the GPU they
// are pinned memory mapped into the device's address space (made at construction, which must not
// be inside a CUDA graph capture): publish() queues a 16-byte copy on the stream (a capture
// records it, so a replayed graph publishes too), and mok-core's combine writes them itself where
// CombineArgs::error_mirror is device_address(). On the CPU publish() copies at once. A word read
// while a copy lands may mix two publishes: a nonzero first word tells the reader that some call
// recorded an error, and the words themselves are to be read from the device after a synchronize.
class ErrorMirror {
 public:
  explicit ErrorMirror(TransportDevice device);
  ~ErrorMirror();
  ErrorMirror(const ErrorMirror&) = delete;
  ErrorMirror& operator=(const ErrorMirror&) = delete;

  // The words' address for the device's kernels and copies (on the CPU the host's).
  std::int64_t device_address() const { return device_address_; }
  // Queue a copy of the words at `error` (int32 [kErrorWords], 4-byte aligned) behind `stream`'s
  // work (on the CPU: copy now).
  void publish(std::int64_t error, std::int64_t stream);
  // The words as they are now (no wait, no CUDA call).
  void read(std::int32_t* out) const;
  // Zero the words (the caller has made sure that no publish is in flight).
  void clear();

 private:
  TransportDevice device_;
  std::int32_t* host_ = nullptr;  // kErrorWords words (pinned and mapped on the GPU)
  std::int64_t device_address_ = 0;
};

// Kernel launchers of cuda/transport.cu: arguments already validated; they never synchronize
// and throw std::runtime_error when the launch fails (on a build without CUDA: always, and the
// entry points above never call them).
void pull_rows_cuda(const transport::PullRows& move, int num_workers, std::int64_t stream);
void push_rows_cuda(const transport::PushRows& move, int num_workers, std::int64_t stream);
void zero_rows_cuda(const transport::ZeroRows& rows, int num_workers, std::int64_t stream);
void barrier_cuda(std::uint64_t* epoch, const std::int64_t* signal_pad_ptrs, int rank,
                  int world_size, std::int32_t* error, int stage, std::int64_t timeout_ns,
                  std::int64_t stream);
// ErrorMirror's CUDA calls.
void mirror_create_cuda(std::int32_t** host, std::int64_t* device_address);
void mirror_destroy_cuda(std::int32_t* host) noexcept;
void mirror_publish_cuda(std::int64_t device_address, const std::int32_t* error,
                         std::int64_t stream);

}  // namespace mok::core
