// bf16 <-> fp32 on uint16 bit patterns, the same bits on the host and the device.
//
// The rounding is torch's: nearest even, overflow to infinity. Every NaN becomes 0x7FFF, the
// canonical NaN of the hardware's conversion (cvt.rn.bf16.f32): the sign and payload of a NaN
// that comes out of fp32 arithmetic depend on the hardware (x86 keeps an operand's payload, and
// which operand depends on the compiler's operand order; CUDA returns its canonical NaN), so
// keeping them would make the bits device-dependent. (torch itself disagrees on NaN: its scalar
// CPU conversion gives 0x7FC0, its vectorized CPU code 0xFFFF, CUDA 0x7FFF.) On the host the
// conversion is integer code, so it never depends on the FPU's modes (no flush-to-zero of
// subnormals, no fast-math rewrite) nor on the compiler; on the device it is the hardware's
// conversion, one instruction a value or a pair, which gives those bits for every number and NaN
// (tests/bf16/test_bf16_grouped_backward.py checks every bf16 gate pattern, NaN and infinities
// included). The GEMM epilogues round with the same conversion.
#pragma once

#include <cstdint>
#include <cstring>

#include "mok/core/hd.h"

namespace mok::core {

MOK_HD inline std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

MOK_HD inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// The fp32 value of a bf16 bit pattern (exact).
MOK_HD inline float bf16_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

// fp32 -> bf16, round to nearest even; any NaN -> 0x7FFF.
MOK_HD inline std::uint16_t float_to_bf16(float x) {
#if defined(__CUDA_ARCH__)
  std::uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#else
  const std::uint32_t u = float_bits(x);
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped
  // half is above one half, or equal to it with the kept half odd; infinity stays infinity and
  // the largest finite values round up into it.
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(is_nan ? 0x7FFFu : rounded);
#endif
}

#if defined(__CUDACC__)
// float_to_bf16 of two values, packed (lo in the lower half), the same bits in one instruction:
// the element kernels' form (expert_math.h's pairs) and the GEMM epilogues'.
__device__ inline std::uint32_t float_to_bf16x2(float lo, float hi) {
  std::uint32_t w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
}
#endif

}  // namespace mok::core
