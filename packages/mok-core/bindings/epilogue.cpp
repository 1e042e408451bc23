// Python binding of the combine epilogue (docs/core-runtime.md "Epilogue").
#include <cstdint>
#include <string>

#include "epilogue_impl.h"
#include "register.h"

namespace mok::core::bindings {

void register_epilogue(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "combine",
      [](const std::string& device, std::uintptr_t out, std::uintptr_t base, std::uintptr_t rows,
         std::uintptr_t weights, std::int64_t num_tokens, std::int64_t topk, std::int64_t hidden,
         std::uintptr_t stream, std::uintptr_t row_index, std::int64_t num_rows,
         std::uintptr_t error, std::uintptr_t error_mirror) {
        CombineArgs a;
        a.out = out;
        a.base = base;
        a.rows = rows;
        a.weights = weights;
        a.num_tokens = num_tokens;
        a.topk = topk;
        a.hidden = hidden;
        a.row_index = row_index;
        a.num_rows = num_rows;
        a.error = error;
        a.error_mirror = error_mirror;
        combine(device, a, stream);
      },
      py::arg("device"), py::arg("out"), py::arg("base"), py::arg("rows"), py::arg("weights"),
      py::arg("num_tokens"), py::arg("topk"), py::arg("hidden"), py::arg("stream") = 0,
      py::arg("row_index") = 0, py::arg("num_rows") = 0, py::arg("error") = 0,
      py::arg("error_mirror") = 0, py::call_guard<py::gil_scoped_release>(),
      "out[t] = bf16(acc), acc = fp32(base[t]) (or +0 when base is 0), then for k ascending "
      "acc = acc + fl(w[t,k] * fp32(rows[t*K+k])) (w = 1 when weights is 0). out, base: bf16 "
      "[T, H]; rows: bf16 [T*K, H]; weights: fp32 [T*K]. out may be base (in place), not rows. "
      "row_index (optional): int32 [T*K], each route's row of rows [num_rows, H] instead of t*K+k "
      "(a table-ordered rows: the schedule's route rows); a row outside [0, num_rows) adds no "
      "term. Bitwise the reference's combine_epilogue. error and error_mirror (optional, both or "
      "neither): the transport's error words (int32 [4]) and an ErrorMirror's device_address, to "
      "which the combine copies the words behind the stream's work (with or without rows).");
}

}  // namespace mok::core::bindings
