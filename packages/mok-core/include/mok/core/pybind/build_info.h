// build_info_dict(): a BuildInfo as the dict every package's build_info() returns (pybind11).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "mok/core/build_info.h"

namespace mok::core {

// Absent facts (no CUDA) become None rather than empty strings or zeros.
inline pybind11::dict build_info_dict(const BuildInfo& info) {
  namespace py = pybind11;
  const auto str_or_none = [](const std::string& s) -> py::object {
    return s.empty() ? py::object(py::none()) : py::object(py::str(s));
  };
  py::object runtime = py::none();
  if (info.cuda_runtime_version > 0) {
    runtime = py::str(std::to_string(info.cuda_runtime_version / 1000) + "." +
                      std::to_string(info.cuda_runtime_version % 1000 / 10));
  }
  py::dict d;
  d["package"] = info.package;
  d["version"] = info.version;
  d["mok_core_version"] = info.mok_core_version;
  d["cuda"] = info.cuda;
  d["cuda_architectures"] = info.cuda_architectures;
  d["cuda_compiler_version"] = str_or_none(info.cuda_compiler_version);
  d["cuda_runtime_version"] = runtime;
  d["cxx_compiler"] = info.cxx_compiler;
  d["build_type"] = info.build_type;
  d["backends"] = info.backends();
  return d;
}

}  // namespace mok::core
