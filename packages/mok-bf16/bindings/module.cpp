// The mok_bf16._C extension module: each concern registers its own functions.
#include "register.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mok BF16 expert kernels (no torch dependency)";
  mok::bf16::bindings::register_build_info(m);
  mok::bf16::bindings::register_experts(m);
  mok::bf16::bindings::register_arith(m);
}
