// The mok_core._C extension module: each concern registers its own functions.
#include "register.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mok-core compiled runtime (no torch dependency)";
  mok::core::bindings::register_build_info(m);
  mok::core::bindings::register_device_query(m);
  mok::core::bindings::register_schedule(m);
  mok::core::bindings::register_epilogue(m);
  mok::core::bindings::register_entry_points(m);
  mok::core::bindings::register_ring(m);
  mok::core::bindings::register_transport(m);
}
