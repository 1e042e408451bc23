// sigmoid(a) for every bf16 a on the host: the CPU loops' counterpart of sigmoid_table.cuh.
//
// The reference's sigmoid (expert_math.h) is a float64 exp and division, ~50 float64 operations
// per element, and its argument is the gate's bf16 value (or the clamp's limit). The table holds
// core::sigmoid of all 65,536 bf16 values, computed on first use (a thread-safe static) by the
// same function on the same machine, so a lookup returns the bits the direct call would; an
// argument that is not a bf16 value (the limit) is computed directly. A NaN entry's payload
// never reaches an output: every result that depends on it is rounded to bf16 (one quiet NaN).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"

namespace mok::core {

// The lookup, as the `sig` argument of swiglu_h and swiglu_backward on the host.
struct HostTableSigmoid {
  float operator()(float a) const {
    std::uint32_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    if ((bits & 0xFFFFu) != 0) return sigmoid(a);  // not a bf16 value: the clamp's limit
    return table()[bits >> 16];
  }

  static const float* table() {
    static const std::vector<float> values = [] {
      std::vector<float> v(1u << 16);
      for (std::uint32_t i = 0; i < (1u << 16); ++i) {
        v[i] = sigmoid(bf16_to_float(static_cast<std::uint16_t>(i)));
      }
      return v;
    }();
    return values.data();
  }
};

}  // namespace mok::core
