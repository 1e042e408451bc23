// The per-element arithmetic of the BF16 experts: mok-core's (mok/core/expert_math.h, shared
// with the other precision packages), under this package's namespace.
#pragma once

#include "mok/core/expert_math.h"

namespace mok::bf16 {

using mok::core::bf16_to_float;
using mok::core::float_to_bf16;

using mok::core::add_rn;
using mok::core::div_rn;
using mok::core::mul_rn;
using mok::core::sub_rn;

using mok::core::clamp_gate;
using mok::core::clamp_up;
using mok::core::exp_f64;
using mok::core::mac_rn;
using mok::core::sigmoid;
using mok::core::swiglu_backward;
using mok::core::swiglu_h;
using mok::core::SwigluGrad;
using mok::core::SwigluLimit;
using mok::core::weighted_bf16;

}  // namespace mok::bf16
