// The register_* functions that module.cpp calls, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

namespace mok::bf16::bindings {

void register_build_info(pybind11::module_& m);  // version(), build_info()
void register_experts(pybind11::module_& m);     // swiglu_forward(), swiglu_backward()
void register_arith(pybind11::module_& m);       // exp_f64(), sigmoid(): for tests

}  // namespace mok::bf16::bindings
