// The register_* functions that module.cpp calls, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

namespace mok::mxfp8::bindings {

void register_build_info(pybind11::module_& m);  // version(), build_info()
void register_quantize(pybind11::module_& m);    // quantize()
void register_experts(pybind11::module_& m);     // swiglu_forward(), swiglu_backward()

}  // namespace mok::mxfp8::bindings
