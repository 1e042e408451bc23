// Python binding of the ring planner (docs/core-runtime.md "Ring planner").
#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "mok/core/ring.h"
#include "mok/core/schedule.h"
#include "register.h"

namespace mok::core::bindings {

void register_ring(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "plan_ring",
      [](int pass, std::int64_t num_rows, std::int64_t macrobatch, std::int64_t minibatch) {
        const auto fail = [](const std::string& what) {
          throw std::invalid_argument("plan_ring: " + what);
        };
        if (pass != kRingForward && pass != kRingBackward) {
          fail("pass must be 0 (forward) or 1 (backward), got " + std::to_string(pass));
        }
        if (num_rows < 0 || num_rows > kMaxTableRows) {
          fail("num_rows must be in [0, 2^31 - 1], got " + std::to_string(num_rows));
        }
        if (macrobatch < 1) fail("macrobatch must be >= 1, got " + std::to_string(macrobatch));
        if (minibatch < 1) fail("minibatch must be >= 1, got " + std::to_string(minibatch));
        std::vector<RingTask> tasks;
        {
          py::gil_scoped_release release;
          tasks.resize(static_cast<std::size_t>(ring_num_tasks(num_rows, macrobatch, minibatch)));
          plan_ring(pass, num_rows, macrobatch, minibatch, tasks.data(),
                    static_cast<std::int64_t>(tasks.size()));
        }
        py::list out(tasks.size());
        for (std::size_t i = 0; i < tasks.size(); ++i) {
          const RingTask& t = tasks[i];
          py::list dependents;
          for (int d = 0; d < t.num_dependents; ++d) dependents.append(t.dependents[d]);
          out[i] =
              py::make_tuple(t.kind, t.macrobatch, t.row_begin, t.row_end, t.num_deps, dependents);
        }
        return out;
      },
      py::arg("pass_"), py::arg("num_rows"), py::arg("macrobatch"), py::arg("minibatch"),
      "Tasks of one pass over the table rows, in issue order, as tuples (kind, macrobatch_index, "
      "row_begin, row_end, num_deps, dependents): pass_ 0 = forward (macrobatches last to "
      "first), 1 = backward (first to last); kind 0 = pull, 1 = compute, 2 = push; dependents "
      "is the list of task indices this task's completion releases. ValueError for bad "
      "arguments.");
}

}  // namespace mok::core::bindings
