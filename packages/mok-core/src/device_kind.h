// The `device` argument of mok-core's calls ("cpu" or "cuda") and the errors around it.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace mok::core {

enum class DeviceKind { kCpu, kCuda };

// Throws std::invalid_argument (ValueError) for anything but "cpu" and "cuda", and
// std::runtime_error for "cuda" in a build without CUDA.
inline DeviceKind parse_device(std::string_view device, std::string_view function) {
  if (device == "cpu") return DeviceKind::kCpu;
  if (device == "cuda") {
#if MOK_WITH_CUDA
    return DeviceKind::kCuda;
#else
    throw std::runtime_error(std::string(function) +
                             ": mok-core was built without CUDA (MOK_CUDA=OFF, or no nvcc at "
                             "build time), so device=\"cuda\" is unavailable; reinstall it with "
                             "nvcc on PATH");
#endif
  }
  throw std::invalid_argument(std::string(function) +
                              ": device must be \"cpu\" or \"cuda\", got \"" + std::string(device) +
                              "\"");
}

// "<function>: <what>" as std::invalid_argument, which pybind11 raises as ValueError.
[[noreturn]] inline void invalid_argument(std::string_view function, const std::string& what) {
  throw std::invalid_argument(std::string(function) + ": " + what);
}

}  // namespace mok::core
