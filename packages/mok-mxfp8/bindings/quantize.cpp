// Python binding of the quantize entry point (include/mok/mxfp8/quantize.h).
#include "mok/mxfp8/quantize.h"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "register.h"

namespace mok::mxfp8::bindings {

void register_quantize(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "quantize",
      [](const std::string& device, std::uintptr_t src, const std::string& src_dtype,
         std::int64_t batch, std::int64_t rows, std::int64_t cols, std::int64_t src_batch_stride,
         std::int64_t src_row_stride, std::int64_t src_col_stride, std::uintptr_t data,
         std::uintptr_t scales, std::int64_t scale_row_stride, std::int64_t scale_block_stride,
         const std::string& rule, std::int64_t num_threads, std::uintptr_t stream,
         std::int64_t data_row_stride) {
        QuantizeArgs a;
        if (src_dtype == "bf16") {
          a.src_type = SourceType::kBf16;
        } else if (src_dtype == "fp32") {
          a.src_type = SourceType::kFp32;
        } else {
          throw std::invalid_argument("quantize: src_dtype must be \"bf16\" or \"fp32\", got \"" +
                                      src_dtype + "\"");
        }
        if (rule == "rceil") {
          a.rule = ScaleRule::kRceil;
        } else if (rule == "floor") {
          a.rule = ScaleRule::kFloor;
        } else {
          throw std::invalid_argument("quantize: rule must be \"rceil\" or \"floor\", got \"" +
                                      rule + "\"");
        }
        a.src = src;
        a.batch = batch;
        a.rows = rows;
        a.cols = cols;
        a.src_batch_stride = src_batch_stride;
        a.src_row_stride = src_row_stride;
        a.src_col_stride = src_col_stride;
        a.data = data;
        a.data_row_stride = data_row_stride;
        a.scales = scales;
        a.scale_row_stride = scale_row_stride;
        a.scale_block_stride = scale_block_stride;
        a.num_threads = num_threads;
        quantize(device, a, stream);
      },
      py::arg("device"), py::arg("src"), py::arg("src_dtype"), py::arg("batch"), py::arg("rows"),
      py::arg("cols"), py::arg("src_batch_stride"), py::arg("src_row_stride"),
      py::arg("src_col_stride"), py::arg("data"), py::arg("scales"), py::arg("scale_row_stride"),
      py::arg("scale_block_stride"), py::arg("rule") = "rceil", py::arg("num_threads") = 1,
      py::arg("stream") = 0, py::arg("data_row_stride") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "MXFP8 quantization (include/mok/mxfp8/format.h) of `batch` matrices [rows, cols] in blocks "
      "of 32 along cols. src: bf16 or fp32 elements at src + b*src_batch_stride + "
      "r*src_row_stride + c*src_col_stride (elements; a transposed copy swaps the row and column "
      "strides). data: uint8 [batch, rows, cols] E4M3 bytes, rows data_row_stride bytes apart (0: "
      "cols; another stride needs batch 1). scales: uint8 E8M0 of block (r, j) at b*rows*cols/32 + "
      "r*scale_row_stride + j*scale_block_stride: row-major (cols/32, 1), block-major (1, rows), "
      "or with the rows (data_row_stride, 1; scales = data + cols: MXFP8 rows). rule: 'rceil' "
      "(smallest scale with no saturation) "
      "or 'floor' (OCP). device 'cpu' (num_threads threads; the bytes do not depend on it) or "
      "'cuda' (stream: a cudaStream_t as an int; the same bytes as the CPU). Raises ValueError "
      "naming a bad argument.");
}

}  // namespace mok::mxfp8::bindings
