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

// A GPU call's error words on their way to the host, for the next call to read without waiting
// (docs/core-runtime.md, "Errors"): take() queues a copy of the words behind the stream's work
// and an event after it; read() gives the words once the event has passed. On the GPU the host
// words are pinned memory and the event one of the current device (made by the first take that
// is not inside a capture); on the CPU the copy is made at once. One object holds one copy at a
// time: taking it again before it is read replaces the copy (on the same stream the new one lands
// after the old).
class ErrorSnapshot {
 public:
  explicit ErrorSnapshot(TransportDevice device);
  ~ErrorSnapshot();
  ErrorSnapshot(const ErrorSnapshot&) = delete;
  ErrorSnapshot& operator=(const ErrorSnapshot&) = delete;

  // The words at `error` (int32 [kErrorWords], 4-byte aligned) behind `stream`'s work; false,
  // with nothing queued, while `stream` is being captured into a CUDA graph.
  bool take(std::int64_t error, std::int64_t stream);
  // Whether the last take's copy has landed (false while `stream` is being captured: an event
  // query would end the capture), then the words in `out`.
  bool read(std::int64_t stream, std::int32_t* out) const;

 private:
  TransportDevice device_;
  std::int32_t* host_ = nullptr;  // kErrorWords words (pinned on the GPU)
  void* event_ = nullptr;         // cudaEvent_t on the GPU
  bool taken_ = false;
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
// ErrorSnapshot's CUDA calls (stream_capturing: whether `stream` is being captured).
void snapshot_create_cuda(std::int32_t** host, void** event);
void snapshot_destroy_cuda(std::int32_t* host, void* event) noexcept;
bool stream_capturing_cuda(std::int64_t stream);
void snapshot_take_cuda(std::int32_t* host, void* event, const std::int32_t* error,
                        std::int64_t stream);
bool snapshot_landed_cuda(void* event);

}  // namespace mok::core
