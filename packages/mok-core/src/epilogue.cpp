// The combine epilogue: argument checks, device dispatch and the CPU loop.
#include "mok/core/epilogue.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "device_kind.h"
#include "epilogue_impl.h"

namespace mok::core {
namespace {

void check_pointer(std::string_view fn, const char* name, std::uintptr_t ptr, std::size_t align,
                   bool needed) {
  if (ptr == 0) {
    if (needed) invalid_argument(fn, std::string(name) + " must not be 0 (a null pointer)");
    return;
  }
  if (ptr % align != 0) {
    invalid_argument(fn, std::string(name) + " must be aligned to " + std::to_string(align) +
                             " bytes, got address " + std::to_string(ptr));
  }
}

}  // namespace

void combine(std::string_view device, const CombineArgs& a, std::uintptr_t stream) {
  constexpr std::string_view fn = "combine";
  const DeviceKind kind = parse_device(device, fn);
  const auto check_size = [&](const char* name, std::int64_t value, std::int64_t min) {
    if (value < min) {
      invalid_argument(fn, std::string(name) + " must be >= " + std::to_string(min) + ", got " +
                               std::to_string(value));
    }
  };
  check_size("num_tokens", a.num_tokens, 0);
  check_size("topk", a.topk, 1);
  check_size("hidden", a.hidden, 0);
  if (a.topk > INT32_MAX)
    invalid_argument(fn, "topk must fit int32, got " + std::to_string(a.topk));
  // rows holds T*K*H elements: that count must fit int64 (and, on the GPU, its indices).
  const std::int64_t routes = a.num_tokens;
  if (a.hidden > 0 && (routes > INT64_MAX / a.topk || routes * a.topk > INT64_MAX / 4 / a.hidden)) {
    invalid_argument(fn, "num_tokens * topk * hidden is too large (" +
                             std::to_string(a.num_tokens) + " * " + std::to_string(a.topk) + " * " +
                             std::to_string(a.hidden) + ")");
  }
  const bool any = a.num_tokens > 0 && a.hidden > 0;
  check_pointer(fn, "out", a.out, 2, any);
  check_pointer(fn, "base", a.base, 2, false);
  check_pointer(fn, "rows", a.rows, 2, any);
  check_pointer(fn, "weights", a.weights, 4, false);
  check_pointer(fn, "row_index", a.row_index, 4, false);
  if (a.row_index != 0) {
    check_size("num_rows", a.num_rows, 0);
    if (a.hidden > 0 && a.num_rows > INT64_MAX / 4 / a.hidden)
      invalid_argument(fn, "num_rows * hidden is too large");
  }
  check_pointer(fn, "error", a.error, 4, a.error_mirror != 0);
  check_pointer(fn, "error_mirror", a.error_mirror, 4, a.error != 0);
  if (kind == DeviceKind::kCpu) {
    if (any) combine_cpu(a);
    if (a.error_mirror != 0) {
      std::memcpy(reinterpret_cast<void*>(a.error_mirror), reinterpret_cast<const void*>(a.error),
                  kErrorMirrorBytes);
    }
    return;
  }
#if MOK_WITH_CUDA
  if (any) {
    combine_cuda(a, stream);
  } else if (a.error_mirror != 0) {
    publish_error_cuda(a, stream);
  }
#else
  (void)stream;
#endif
}

void combine_cpu(const CombineArgs& a) {
  auto* out = reinterpret_cast<std::uint16_t*>(a.out);
  const auto* base = reinterpret_cast<const std::uint16_t*>(a.base);
  const auto* rows = reinterpret_cast<const std::uint16_t*>(a.rows);
  const auto* weights = reinterpret_cast<const float*>(a.weights);
  const auto* row_index = reinterpret_cast<const std::int32_t*>(a.row_index);
  const std::int64_t K = a.topk;
  const std::int64_t H = a.hidden;
  // combine_element's sequence, with h innermost so that the compiler can vectorize each step
  // over a token's row (element-wise, so the bits are the same).
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t t = 0; t < a.num_tokens; ++t) {
    for (std::int64_t h = 0; h < H; ++h) acc[h] = combine_init(base, t * H + h);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t route = t * K + k;
      const std::int64_t r = combine_row(route, row_index, a.num_rows);
      if (r < 0) continue;
      const std::uint16_t* row = rows + r * H;
      const bool weighted = weights != nullptr;
      const float w = weighted ? weights[route] : 1.0f;
      for (std::int64_t h = 0; h < H; ++h) acc[h] = combine_step(acc[h], row[h], weighted, w);
    }
    for (std::int64_t h = 0; h < H; ++h) out[t * H + h] = float_to_bf16(acc[h]);
  }
}

}  // namespace mok::core
