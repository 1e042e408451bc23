// The transport's host side: argument checks, the CPU backend (threads over row ranges, the epoch
// barrier over POSIX shared memory) and the hand-off to the CUDA launchers.
#include "transport.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

namespace mok::core {
namespace {

using transport::PullRows;
using transport::PushRows;
using transport::ZeroRows;

void require(bool ok, const char* fn, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(fn) + ": " + what);
}

std::string got(std::int64_t v) { return ", got " + std::to_string(v); }

// A pointer argument: a non-negative int, non-zero unless `may_be_null`, aligned to `align`.
void check_pointer(const char* fn, const char* name, std::int64_t p, std::int64_t align,
                   bool may_be_null) {
  require(p >= 0, fn, std::string(name) + " must be an address (a non-negative int)" + got(p));
  require(may_be_null || p != 0, fn, std::string(name) + " must not be 0 (null)");
  require(p % align == 0, fn,
          std::string(name) + " must be " + std::to_string(align) + "-byte aligned" + got(p));
}

// The checks pull_rows and push_rows share. Pointers only matter when a row is moved: an empty
// tensor's data_ptr() is 0.
// The checks of a table of rows: its size, one stride and the workers. Row offsets are computed
// in int64: tables whose last row would overflow them are refused.
void check_rows(const char* fn, std::int64_t capacity, std::int64_t row_bytes, const char* stride,
                std::int64_t stride_bytes, std::int64_t num_workers) {
  require(capacity >= 0, fn, "capacity must be >= 0" + got(capacity));
  require(row_bytes >= 0, fn, "row_bytes must be >= 0" + got(row_bytes));
  require(stride_bytes >= row_bytes, fn,
          std::string(stride) + " must be >= row_bytes (" + std::to_string(row_bytes) + ")" +
              got(stride_bytes));
  require(num_workers >= 1 && num_workers <= transport::kMaxWorkers, fn,
          "num_workers must be in [1, " + std::to_string(transport::kMaxWorkers) + "]" +
              got(num_workers));
  require(capacity == 0 || stride_bytes <= std::numeric_limits<std::int64_t>::max() / capacity, fn,
          "capacity * " + std::string(stride) + " overflows int64");
}

void check_row_move(const char* fn, const char* rows, std::int64_t rows_ptr, const char* ptrs,
                    std::int64_t ptrs_ptr, std::int64_t ptrs_align, std::int64_t row_src_rank,
                    std::int64_t row_route, std::int64_t capacity, std::int64_t row_bytes,
                    std::int64_t src_stride, std::int64_t dst_stride, std::int64_t num_workers) {
  check_rows(fn, capacity, row_bytes, "src_stride", src_stride, num_workers);
  check_rows(fn, capacity, row_bytes, "dst_stride", dst_stride, num_workers);
  const bool idle = capacity == 0;
  check_pointer(fn, rows, rows_ptr, 1, idle || row_bytes == 0);
  check_pointer(fn, ptrs, ptrs_ptr, ptrs_align, idle);
  check_pointer(fn, "row_src_rank", row_src_rank, 4, idle);
  check_pointer(fn, "row_route", row_route, 4, idle);
}

#if !MOK_WITH_CUDA
[[noreturn]] void no_cuda(const char* fn) {
  throw std::runtime_error(std::string(fn) +
                           ": device=\"cuda\" but mok-core was built without CUDA (MOK_CUDA=OFF, "
                           "or no nvcc at build time); reinstall it with nvcc on PATH");
}
#endif

// Runs a row operation where `device` says, when there is work (rows of at least one byte):
// the CUDA launcher, or the CPU loop. device="cuda" on a build without CUDA always raises.
template <class Cuda, class Cpu>
void on_device(TransportDevice device, const char* fn, bool work, const Cuda& cuda,
               const Cpu& cpu) {
  if (device == TransportDevice::kCuda) {
#if MOK_WITH_CUDA
    (void)fn;
    if (work) cuda();
    return;
#else
    (void)cuda;
    no_cuda(fn);
#endif
  }
  if (work) cpu();
}

// Bytes of rows a CPU worker thread must have to be worth starting: a thread costs tens of
// microseconds to start and join, a 64 KiB copy a few. A layer call's moves at small shapes
// (hundreds of rows of a few KB) then run on the calling thread alone, where 16 workers (the
// default of MoKConfig's comm SMs) spent ~3 ms a move starting threads.
constexpr std::int64_t kMinWorkerBytes = 64 * 1024;

// Runs body(begin, end) over [0, capacity) split into contiguous ranges, one per worker: at most
// num_workers of them, and one per kMinWorkerBytes of the rows' bytes (who moves a row never
// changes its bytes). Worker 0 is the calling thread. Every started thread is joined, even when
// starting another one fails.
template <typename Body>
void for_row_ranges(std::int64_t capacity, std::int64_t row_bytes, std::int64_t num_workers,
                    const Body& body) {
  const std::int64_t by_bytes = capacity * row_bytes / kMinWorkerBytes;
  std::int64_t n = num_workers < capacity ? num_workers : capacity;
  if (by_bytes < n) n = by_bytes;
  if (n <= 1) {
    if (capacity > 0) body(0, capacity);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n - 1));
  std::exception_ptr failure;
  try {
    for (std::int64_t w = 1; w < n; ++w) {
      std::int64_t begin = 0, end = 0;
      transport::worker_rows(capacity, n, w, &begin, &end);
      threads.emplace_back([&body, begin, end] { body(begin, end); });
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (!failure) {
    std::int64_t begin = 0, end = 0;
    transport::worker_rows(capacity, n, 0, &begin, &end);
    body(begin, end);
  }
  for (std::thread& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
}

void pull_rows_cpu(const PullRows& move, std::int64_t num_workers) {
  const auto body = [&move](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const unsigned char* src = move.src_row(i);
      if (src != nullptr) {
        std::memcpy(move.dst_row(i), src, static_cast<size_t>(move.row_bytes));
      } else {
        std::memset(move.dst_row(i), 0, static_cast<size_t>(move.row_bytes));
      }
    }
  };
  for_row_ranges(move.capacity, move.row_bytes, num_workers, body);
}

void push_rows_cpu(const PushRows& move, std::int64_t num_workers) {
  const auto body = [&move](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      unsigned char* dst = move.dst_row(i);
      if (dst != nullptr) std::memcpy(dst, move.src_row(i), static_cast<size_t>(move.row_bytes));
    }
  };
  for_row_ranges(move.capacity, move.row_bytes, num_workers, body);
}

void zero_rows_cpu(const ZeroRows& rows, std::int64_t num_workers) {
  const auto body = [&rows](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      if (rows.padding(i)) std::memset(rows.dst_row(i), 0, static_cast<size_t>(rows.row_bytes));
    }
  };
  for_row_ranges(rows.capacity, rows.row_bytes, num_workers, body);
}

// The CPU side of the barrier protocol. The pads live in POSIX shared memory mapped by several
// processes: GCC/Clang __atomic builtins on naturally aligned words are lock-free and
// address-free, so they order correctly across processes as well as threads.
struct HostSync {
  static void store_release(std::uint64_t* p, std::uint64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
  }
  static void store_release(std::int32_t* p, std::int32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
  }
  static void store_relaxed(std::int32_t* p, std::int32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
  }
  static std::uint64_t load_acquire(const std::uint64_t* p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
  }
  static std::int32_t load_acquire(const std::int32_t* p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
  }
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // Spin briefly, then yield, then sleep: CI runs 3 ranks on 2 cores, where a rank that only spins
  // would keep the one it waits for off the CPU.
  static void pause(std::uint32_t spins) {
    if (spins < 128) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#elif defined(__aarch64__)
      asm volatile("yield" ::: "memory");
#endif
    } else if (spins < 1024) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
};

bool barrier_cpu(std::uint64_t* epoch, const std::int64_t* pad_ptrs, std::int32_t rank,
                 std::int32_t world_size, std::int32_t* error, std::int32_t stage,
                 std::int64_t timeout_ns) {
  // The epoch is this rank's own word: a plain increment (one caller at a time).
  const std::uint64_t e = ++*epoch;
  // Arrive even when the error is set, so that the count of barriers stays the same on every
  // rank and healthy peers are not held up by this one.
  const auto tag = static_cast<std::uint32_t>(stage);
  transport::barrier_arrive<HostSync>(pad_ptrs, rank, world_size, e, tag, 0, 1);
  if (HostSync::load_acquire(error + transport::kErrorCode) != 0) return false;
  const transport::BarrierMiss miss =
      transport::barrier_wait<HostSync>(pad_ptrs, rank, world_size, e, tag, timeout_ns, 0, 1);
  if (miss.peer < 0) return true;
  transport::record_error<HostSync>(error, miss.code, miss.peer, stage, rank);
  return false;
}

}  // namespace

#if !MOK_WITH_CUDA
// The launchers of a build without CUDA: on_device raises before it could call them.
void pull_rows_cuda(const PullRows&, int, std::int64_t) { no_cuda("pull_rows"); }
void push_rows_cuda(const PushRows&, int, std::int64_t) { no_cuda("push_rows"); }
void zero_rows_cuda(const ZeroRows&, int, std::int64_t) { no_cuda("zero_rows"); }
#endif

TransportDevice parse_transport_device(const std::string& device) {
  if (device == "cpu") return TransportDevice::kCpu;
  if (device == "cuda") return TransportDevice::kCuda;
  throw std::invalid_argument("device must be \"cpu\" or \"cuda\", got \"" + device + "\"");
}

void pull_rows(TransportDevice device, std::int64_t dst, std::int64_t src_ptrs,
               std::int64_t row_src_rank, std::int64_t row_route, std::int64_t capacity,
               std::int64_t route_divisor, std::int64_t row_bytes, std::int64_t src_stride,
               std::int64_t dst_stride, std::int64_t num_workers, std::int64_t stream) {
  constexpr const char* fn = "pull_rows";
  check_row_move(fn, "dst", dst, "src_ptrs", src_ptrs, 8, row_src_rank, row_route, capacity,
                 row_bytes, src_stride, dst_stride, num_workers);
  require(route_divisor >= 1, fn, "route_divisor must be >= 1" + got(route_divisor));
  check_pointer(fn, "stream", stream, 1, true);
  const PullRows move{reinterpret_cast<unsigned char*>(dst),
                      reinterpret_cast<const std::int64_t*>(src_ptrs),
                      reinterpret_cast<const std::int32_t*>(row_src_rank),
                      reinterpret_cast<const std::int32_t*>(row_route),
                      capacity,
                      route_divisor,
                      row_bytes,
                      src_stride,
                      dst_stride};
  on_device(
      device, fn, capacity > 0 && row_bytes > 0,
      [&] { pull_rows_cuda(move, static_cast<int>(num_workers), stream); },
      [&] { pull_rows_cpu(move, num_workers); });
}

void push_rows(TransportDevice device, std::int64_t src, std::int64_t dst_ptrs,
               std::int64_t row_src_rank, std::int64_t row_route, std::int64_t capacity,
               std::int64_t row_bytes, std::int64_t src_stride, std::int64_t dst_stride,
               std::int64_t num_workers, std::int64_t stream, std::int64_t src_divisor,
               std::int64_t dst_local) {
  constexpr const char* fn = "push_rows";
  const bool local = dst_local != 0;
  require(!(local && dst_ptrs != 0), fn,
          "give dst_ptrs (the ranks' destinations) or dst_local (this process's), not both");
  // With dst_local, dst_ptrs is unused: dst_local is checked in its place (rows, any alignment;
  // dst_ptrs an int64 array).
  check_row_move(fn, "src", src, local ? "dst_local" : "dst_ptrs", local ? dst_local : dst_ptrs,
                 local ? 1 : 8, row_src_rank, row_route, capacity, row_bytes, src_stride,
                 dst_stride, num_workers);
  require(src_divisor >= 1, fn, "src_divisor must be >= 1" + got(src_divisor));
  check_pointer(fn, "stream", stream, 1, true);
  const PushRows move{reinterpret_cast<const unsigned char*>(src),
                      reinterpret_cast<const std::int64_t*>(dst_ptrs),
                      reinterpret_cast<const std::int32_t*>(row_src_rank),
                      reinterpret_cast<const std::int32_t*>(row_route),
                      capacity,
                      row_bytes,
                      src_stride,
                      dst_stride,
                      src_divisor,
                      reinterpret_cast<unsigned char*>(dst_local)};
  on_device(
      device, fn, capacity > 0 && row_bytes > 0,
      [&] { push_rows_cuda(move, static_cast<int>(num_workers), stream); },
      [&] { push_rows_cpu(move, num_workers); });
}

void zero_rows(TransportDevice device, std::int64_t dst, std::int64_t row_src_rank,
               std::int64_t capacity, std::int64_t row_bytes, std::int64_t dst_stride,
               std::int64_t num_workers, std::int64_t stream) {
  constexpr const char* fn = "zero_rows";
  check_rows(fn, capacity, row_bytes, "dst_stride", dst_stride, num_workers);
  const bool idle = capacity == 0;
  check_pointer(fn, "dst", dst, 1, idle || row_bytes == 0);
  check_pointer(fn, "row_src_rank", row_src_rank, 4, idle);
  check_pointer(fn, "stream", stream, 1, true);
  const ZeroRows rows{reinterpret_cast<unsigned char*>(dst),
                      reinterpret_cast<const std::int32_t*>(row_src_rank), capacity, row_bytes,
                      dst_stride};
  on_device(
      device, fn, capacity > 0 && row_bytes > 0,
      [&] { zero_rows_cuda(rows, static_cast<int>(num_workers), stream); },
      [&] { zero_rows_cpu(rows, num_workers); });
}

bool barrier(TransportDevice device, std::int64_t epoch, std::int64_t signal_pad_ptrs,
             std::int64_t rank, std::int64_t world_size, std::int64_t error, std::int64_t stage,
             std::int64_t timeout_ns, std::int64_t stream) {
  constexpr const char* fn = "barrier";
  constexpr std::int64_t int32_max = std::numeric_limits<std::int32_t>::max();
  require(world_size >= 1 && world_size <= int32_max, fn,
          "world_size must be >= 1" + got(world_size));
  require(rank >= 0 && rank < world_size, fn,
          "rank must be in [0, world_size=" + std::to_string(world_size) + ")" + got(rank));
  require(stage >= 0 && stage <= static_cast<std::int64_t>(transport::kTagMask), fn,
          "stage must be in [0, 2^24) (the barrier's tag, announced to the peers and stored in the "
          "error words)" +
              got(stage));
  require(timeout_ns > 0, fn, "timeout_ns must be > 0" + got(timeout_ns));
  check_pointer(fn, "epoch", epoch, 8, false);
  check_pointer(fn, "signal_pad_ptrs", signal_pad_ptrs, 8, false);
  check_pointer(fn, "error", error, 4, false);
  check_pointer(fn, "stream", stream, 1, true);
  auto* epoch_word = reinterpret_cast<std::uint64_t*>(epoch);
  const auto* pads = reinterpret_cast<const std::int64_t*>(signal_pad_ptrs);
  auto* error_words = reinterpret_cast<std::int32_t*>(error);
  if (device == TransportDevice::kCuda) {
#if MOK_WITH_CUDA
    barrier_cuda(epoch_word, pads, static_cast<int>(rank), static_cast<int>(world_size),
                 error_words, static_cast<int>(stage), timeout_ns, stream);
    return true;
#else
    no_cuda(fn);
#endif
  }
  // On the CPU the pad addresses are host memory: check them before any process waits on them.
  for (std::int64_t r = 0; r < world_size; ++r) {
    const std::string name = "signal_pad_ptrs[" + std::to_string(r) + "]";
    check_pointer(fn, name.c_str(), pads[r], 8, false);
  }
  return barrier_cpu(epoch_word, pads, static_cast<std::int32_t>(rank),
                     static_cast<std::int32_t>(world_size), error_words,
                     static_cast<std::int32_t>(stage), timeout_ns);
}

ErrorMirror::ErrorMirror(TransportDevice device) : device_(device) {
  if (device_ == TransportDevice::kCuda) {
#if MOK_WITH_CUDA
    mirror_create_cuda(&host_, &device_address_);
#else
    no_cuda("ErrorMirror");
#endif
  } else {
    host_ = new std::int32_t[transport::kErrorWords]();
    device_address_ = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(host_));
  }
}

ErrorMirror::~ErrorMirror() {
  if (device_ == TransportDevice::kCuda) {
#if MOK_WITH_CUDA
    mirror_destroy_cuda(host_);
#endif
  } else {
    delete[] host_;
  }
}

void ErrorMirror::publish(std::int64_t error, std::int64_t stream) {
  constexpr const char* fn = "ErrorMirror.publish";
  check_pointer(fn, "error", error, 4, false);
  check_pointer(fn, "stream", stream, 1, true);
  const auto* from = reinterpret_cast<const std::int32_t*>(error);
  if (device_ == TransportDevice::kCuda) {
#if MOK_WITH_CUDA
    mirror_publish_cuda(device_address_, from, stream);
#endif
  } else {
    std::memcpy(host_, from, transport::kErrorWords * sizeof(std::int32_t));
  }
}

void ErrorMirror::read(std::int32_t* out) const {
  // (volatile: the device writes these words behind the compiler's back)
  const volatile std::int32_t* words = host_;
  for (int i = 0; i < transport::kErrorWords; ++i) out[i] = words[i];
}

void ErrorMirror::clear() {
  volatile std::int32_t* words = host_;
  for (int i = 0; i < transport::kErrorWords; ++i) words[i] = 0;
}

}  // namespace mok::core
