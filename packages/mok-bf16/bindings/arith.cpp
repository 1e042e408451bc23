// Python bindings of the reference arithmetic's element functions (mok/bf16/expert_math.h), so
// that tests can hold them against mok-torch's reference bit for bit.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "mok/bf16/expert_math.h"
#include "register.h"

namespace mok::bf16::bindings {
namespace {

void check_array(const char* fn, const char* name, std::uintptr_t ptr, std::uintptr_t align,
                 std::int64_t count) {
  if (ptr == 0 && count > 0) {
    throw std::invalid_argument(std::string(fn) + ": " + name + " must not be 0 (a null pointer)");
  }
  if (ptr % align != 0) {
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be aligned to " +
                                std::to_string(align) + " bytes");
  }
}

void check_count(const char* fn, std::int64_t count) {
  if (count < 0) {
    throw std::invalid_argument(std::string(fn) + ": count must be >= 0, got " +
                                std::to_string(count));
  }
}

}  // namespace

void register_arith(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "exp_f64",
      [](std::uintptr_t x, std::uintptr_t out, std::int64_t count) {
        check_count("exp_f64", count);
        check_array("exp_f64", "x", x, 8, count);
        check_array("exp_f64", "out", out, 8, count);
        const auto* in = reinterpret_cast<const double*>(x);
        auto* o = reinterpret_cast<double*>(out);
        for (std::int64_t i = 0; i < count; ++i) o[i] = exp_f64(in[i]);
      },
      py::arg("x"), py::arg("out"), py::arg("count"), py::call_guard<py::gil_scoped_release>(),
      "out[i] = exp(x[i]) for float64 arrays in host memory, with the expert kernels' exp: "
      "bitwise mok-torch's reference exp_f64 (for tests).");
  m.def(
      "sigmoid",
      [](std::uintptr_t a, std::uintptr_t out, std::int64_t count) {
        check_count("sigmoid", count);
        check_array("sigmoid", "a", a, 4, count);
        check_array("sigmoid", "out", out, 4, count);
        const auto* in = reinterpret_cast<const float*>(a);
        auto* o = reinterpret_cast<float*>(out);
        for (std::int64_t i = 0; i < count; ++i) o[i] = sigmoid(in[i]);
      },
      py::arg("a"), py::arg("out"), py::arg("count"), py::call_guard<py::gil_scoped_release>(),
      "out[i] = fp32(1 / (1 + exp(-a[i]))) computed in float64, for float32 arrays in host "
      "memory, with the expert kernels' arithmetic: bitwise mok-torch's reference sigmoid (for "
      "tests).");
}

}  // namespace mok::bf16::bindings
