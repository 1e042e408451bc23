// mok-core's own build facts (compiled into mok_core._C, so not a public header).
#pragma once

#include "mok/core/build_info.h"

namespace mok::core {

BuildInfo build_info();

}  // namespace mok::core
