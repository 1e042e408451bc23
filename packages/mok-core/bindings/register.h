// The register_* functions that module.cpp calls, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

namespace mok::core::bindings {

void register_build_info(pybind11::module_& m);    // version(), build_info()
void register_device_query(pybind11::module_& m);  // cuda_device_count(), cuda_device_properties()
void register_schedule(pybind11::module_& m);      // schedule_capacity(), build_table(), ...
void register_epilogue(pybind11::module_& m);      // combine()
void register_entry_points(pybind11::module_& m);  // entry_points(): for other extension modules
void register_ring(pybind11::module_& m);          // plan_ring()
void register_transport(pybind11::module_& m);  // pull_rows(), push_rows(), barrier(), ShmSegment

}  // namespace mok::core::bindings
