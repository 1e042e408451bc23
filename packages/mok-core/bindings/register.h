// The register_* functions that module.cpp calls, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

namespace mok::core::bindings {

void register_build_info(pybind11::module_& m);    // version(), build_info()
void register_device_query(pybind11::module_& m);  // cuda_device_count(), cuda_device_properties()

}  // namespace mok::core::bindings
