// The register_* functions that module.cpp calls, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

namespace mok::bf16::bindings {

void register_build_info(pybind11::module_& m);  // version(), build_info()

}  // namespace mok::bf16::bindings
