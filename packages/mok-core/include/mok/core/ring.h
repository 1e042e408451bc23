// The ring planner (docs/design.md §8, docs/core-runtime.md "Ring planner"): the tasks of one pass
// over the table's rows, with their dependencies, as host/device code.
//
// Rows [0, num_rows) split into macrobatches of `macrobatch` rows (the ring: the routed
// activation buffers hold one), each split into minibatches of `minibatch` rows (the overlap
// granularity); the last of each may be partial. A minibatch's ring slot is its index within
// its macrobatch, so slot j of every macrobatch occupies the same ring rows.
//
//   pass 0 (forward):  macrobatches last to first, so the ring ends holding macrobatch 0;
//   pass 1 (backward): macrobatches first to last.
//
// Within a macrobatch, minibatches go in row order, each as three tasks in issue order:
// pull (rows into its slot) -> compute -> push (results back to the sources). A pull also
// waits for the compute of the minibatch that held its slot before, which is slot j of the
// macrobatch issued just before (every macrobatch but the last is full, so an earlier holder
// is always there, unless the previous one is the partial last macrobatch with fewer slots).
// Every dependency points to an earlier task, so executing in issue order is valid, and so is
// splitting the list by kind (communication and compute workers) keeping each sub-order.
//
// Tasks are computed in O(1) from their index (ring_task), so a device-side scheduler can
// derive task i on the fly; plan_ring fills a caller's fixed-size array with all of them.
#pragma once

#include <cstdint>

#include "mok/core/hd.h"

namespace mok::core {

enum RingPass : int { kRingForward = 0, kRingBackward = 1 };
enum RingTaskKind : int { kRingPull = 0, kRingCompute = 1, kRingPush = 2 };

// A compute releases its push and the next pull of its slot; nothing releases more.
inline constexpr int kRingMaxDependents = 2;

struct RingTask {
  int kind;                 // RingTaskKind
  std::int32_t macrobatch;  // index of the macrobatch: rows [m*macrobatch, ...)
  std::int64_t row_begin;   // table rows [row_begin, row_end)
  std::int64_t row_end;
  int num_deps;                                 // tasks this one waits for
  int num_dependents;                           // entries of dependents in use
  std::int64_t dependents[kRingMaxDependents];  // tasks its completion releases, ascending
};

// The shape of a plan: macrobatch count, minibatches of a full one and of the last one.
struct RingShape {
  std::int64_t num_macrobatches;
  std::int64_t minibatches_full;
  std::int64_t minibatches_last;

  MOK_HD std::int64_t num_tasks() const {
    return num_macrobatches == 0
               ? 0
               : 3 * ((num_macrobatches - 1) * minibatches_full + minibatches_last);
  }
};

MOK_HD inline std::int64_t ring_ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Sizes must satisfy num_rows >= 0, macrobatch >= 1, minibatch >= 1 (ring_valid_args).
MOK_HD inline bool ring_valid_args(int pass, std::int64_t num_rows, std::int64_t macrobatch,
                                   std::int64_t minibatch) {
  return (pass == kRingForward || pass == kRingBackward) && num_rows >= 0 && macrobatch >= 1 &&
         minibatch >= 1;
}

MOK_HD inline RingShape ring_shape(std::int64_t num_rows, std::int64_t macrobatch,
                                   std::int64_t minibatch) {
  RingShape s{0, 0, 0};
  if (num_rows <= 0) return s;
  s.num_macrobatches = ring_ceil_div(num_rows, macrobatch);
  const std::int64_t full_rows = macrobatch < num_rows ? macrobatch : num_rows;
  s.minibatches_full = ring_ceil_div(full_rows, minibatch);
  const std::int64_t last_rows = num_rows - (s.num_macrobatches - 1) * macrobatch;
  s.minibatches_last = ring_ceil_div(last_rows, minibatch);
  return s;
}

MOK_HD inline std::int64_t ring_num_tasks(std::int64_t num_rows, std::int64_t macrobatch,
                                          std::int64_t minibatch) {
  return ring_shape(num_rows, macrobatch, minibatch).num_tasks();
}

namespace detail {

// Macrobatch issued at position p of the pass.
MOK_HD inline std::int64_t ring_macrobatch_at(int pass, const RingShape& s, std::int64_t p) {
  return pass == kRingForward ? s.num_macrobatches - 1 - p : p;
}

MOK_HD inline std::int64_t ring_minibatches_of(const RingShape& s, std::int64_t m) {
  return m == s.num_macrobatches - 1 ? s.minibatches_last : s.minibatches_full;
}

// Minibatches issued before position p.
MOK_HD inline std::int64_t ring_minibatches_before(int pass, const RingShape& s, std::int64_t p) {
  if (pass == kRingBackward) return p * s.minibatches_full;
  return p == 0 ? 0 : s.minibatches_last + (p - 1) * s.minibatches_full;
}

}  // namespace detail

// Task `index` (0 <= index < ring_num_tasks) of the plan; arguments as ring_valid_args.
MOK_HD inline RingTask ring_task(int pass, std::int64_t num_rows, std::int64_t macrobatch,
                                 std::int64_t minibatch, std::int64_t index) {
  using namespace detail;
  const RingShape s = ring_shape(num_rows, macrobatch, minibatch);
  const std::int64_t q = index / 3;  // minibatch in issue order
  const int kind = static_cast<int>(index % 3);
  // Position p of its macrobatch in the pass and slot j within it.
  std::int64_t p, j;
  const std::int64_t first = pass == kRingForward ? s.minibatches_last : s.minibatches_full;
  if (q < first) {
    p = 0;
    j = q;
  } else {
    p = 1 + (q - first) / s.minibatches_full;
    j = (q - first) % s.minibatches_full;
  }
  const std::int64_t m = ring_macrobatch_at(pass, s, p);
  const std::int64_t macro_end = (m + 1) * macrobatch < num_rows ? (m + 1) * macrobatch : num_rows;

  RingTask task{};
  task.kind = kind;
  task.macrobatch = static_cast<std::int32_t>(m);
  task.row_begin = m * macrobatch + j * minibatch;
  task.row_end = task.row_begin + minibatch < macro_end ? task.row_begin + minibatch : macro_end;
  task.num_deps = 0;
  task.num_dependents = 0;
  const std::int64_t pull = 3 * q;  // this minibatch's tasks: pull, pull + 1, pull + 2
  switch (kind) {
    case kRingPull:
      task.num_deps = 1;  // ... unless nobody held the slot: fixed below
      if (p == 0 || j >= ring_minibatches_of(s, ring_macrobatch_at(pass, s, p - 1))) {
        task.num_deps = 0;
      }
      task.dependents[task.num_dependents++] = pull + 1;
      break;
    case kRingCompute:
      task.num_deps = 1;
      task.dependents[task.num_dependents++] = pull + 2;
      if (p + 1 < s.num_macrobatches &&
          j < ring_minibatches_of(s, ring_macrobatch_at(pass, s, p + 1))) {
        task.dependents[task.num_dependents++] = 3 * (ring_minibatches_before(pass, s, p + 1) + j);
      }
      break;
    default:  // kRingPush
      task.num_deps = 1;
      break;
  }
  return task;
}

// Fills tasks[0, n) with the plan in issue order and returns n = ring_num_tasks(...); writes
// nothing and returns n when n > max_tasks, and returns -1 for invalid arguments.
MOK_HD inline std::int64_t plan_ring(int pass, std::int64_t num_rows, std::int64_t macrobatch,
                                     std::int64_t minibatch, RingTask* tasks,
                                     std::int64_t max_tasks) {
  if (!ring_valid_args(pass, num_rows, macrobatch, minibatch)) return -1;
  const std::int64_t n = ring_num_tasks(num_rows, macrobatch, minibatch);
  if (n > max_tasks) return n;
  for (std::int64_t i = 0; i < n; ++i)
    tasks[i] = ring_task(pass, num_rows, macrobatch, minibatch, i);
  return n;
}

}  // namespace mok::core
