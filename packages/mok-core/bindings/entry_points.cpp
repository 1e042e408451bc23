// Python binding of mok-core's entry points for other extension modules
// (include/mok/core/entry_points.h).
#include "mok/core/entry_points.h"

#include "register.h"

namespace mok::core::bindings {

void register_entry_points(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "entry_points",
      [] {
        // (a static table: the capsule owns nothing)
        return py::capsule(const_cast<EntryPoints*>(&entry_points()), kEntryPointsCapsule);
      },
      "mok-core's table build and combine as C function pointers in a PyCapsule named "
      "'mok_core.entry_points', for another extension module to call inside one of its own "
      "calls (mok_bf16.moe_forward_call). Not for Python code.");
}

}  // namespace mok::core::bindings
