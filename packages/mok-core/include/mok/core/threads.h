// CPU worker threads for the packages' CPU loops: every started thread is joined and the first
// exception of any worker is rethrown. How work is split changes who computes an element,
// never how, so results never depend on the thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace mok::core {

// Runs work(w) for w in [0, workers), worker 0 on the calling thread. Every started thread is
// joined; the first exception of any worker (or of starting one) is rethrown after that.
template <typename Work>
void run_workers(std::int64_t workers, const Work& work) {
  if (workers <= 0) return;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
  const auto guarded = [&work, &errors](std::int64_t w) {
    try {
      work(w);
    } catch (...) {
      errors[static_cast<std::size_t>(w)] = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(static_cast<std::size_t>(workers - 1));
    for (std::int64_t w = 1; w < workers; ++w) threads.emplace_back(guarded, w);
  } catch (...) {
    errors[0] = std::current_exception();  // some work will not run: fail the call
  }
  if (!errors[0]) guarded(0);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// body(begin, end) over [0, n) in contiguous ranges, one per thread.
template <typename Body>
void parallel_ranges(std::int64_t n, std::int64_t num_threads, const Body& body) {
  const std::int64_t workers = std::min(num_threads, n);
  run_workers(workers, [&](std::int64_t w) { body(n * w / workers, n * (w + 1) / workers); });
}

// work(item) for items [0, n), handed out by an atomic counter (it picks who, not how).
template <typename Work>
void parallel_items(std::int64_t n, std::int64_t num_threads, const Work& work) {
  std::atomic<std::int64_t> next{0};
  run_workers(std::min(num_threads, n), [&](std::int64_t) {
    for (std::int64_t i = next++; i < n; i = next++) work(i);
  });
}

}  // namespace mok::core
