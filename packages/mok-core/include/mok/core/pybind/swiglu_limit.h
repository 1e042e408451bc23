// swiglu_limit(): the optional SwiGLU clamp as the expert bindings of every package take it.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>

#include "mok/core/expert_math.h"

namespace mok::core {

// None: no clamp. The limit is applied in fp32, as torch applies a Python float to fp32 data.
inline SwigluLimit swiglu_limit(const char* fn, std::optional<double> limit) {
  if (!limit) return {};
  if (!(*limit >= 0.0)) {
    throw std::invalid_argument(std::string(fn) + ": limit must be None or a number >= 0, got " +
                                std::to_string(*limit));
  }
  return {true, static_cast<float>(*limit)};
}

}  // namespace mok::core
