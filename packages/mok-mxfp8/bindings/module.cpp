// The mok_mxfp8._C extension module: each concern registers its own functions.
#include "register.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mok MXFP8 quantization and FP8 expert kernels (no torch dependency)";
  mok::mxfp8::bindings::register_build_info(m);
  mok::mxfp8::bindings::register_quantize(m);
  mok::mxfp8::bindings::register_experts(m);
}
