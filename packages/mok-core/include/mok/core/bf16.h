// bf16 <-> fp32 on uint16 bit patterns, the same on the host and the device.
//
// Integer code only, so the result never depends on the FPU's modes (no flush-to-zero of
// subnormals, no fast-math rewrite) nor on the compiler. The rounding is torch's: nearest even,
// overflow to infinity. Every NaN becomes the quiet NaN 0x7FC0 (torch's scalar conversion):
// the sign and payload of a NaN that comes out of fp32 arithmetic depend on the hardware (x86
// keeps an operand's payload, and which operand depends on the compiler's operand order; CUDA
// returns its canonical NaN), so keeping them would make the bits device-dependent. (torch
// itself disagrees on NaN: its vectorized CPU code gives 0xFFFF, CUDA's cvt.rn.bf16.f32 0x7FFF.)
// The device's float_to_bf16x2 (below) gives these bits for two values at once.
// One exception by design: mok-bf16's GEMM epilogues (grouped_gemm.cuh's pack_bf16) round with
// that hardware conversion, one instruction a pair: the same bits for every number, 0x7FFF for
// a NaN (docs/determinism.md "The GPU GEMMs").
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

// fp32 -> bf16, round to nearest even; any NaN -> 0x7FC0.
MOK_HD inline std::uint16_t float_to_bf16(float x) {
  const std::uint32_t u = float_bits(x);
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  // Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped
  // half is above one half, or equal to it with the kept half odd; infinity stays infinity and
  // the largest finite values round up into it.
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(is_nan ? 0x7FC0u : rounded);
}

#if defined(__CUDACC__)
// float_to_bf16 of two values, packed (lo in the lower half), the same bits: the hardware's
// conversion rounds a pair to nearest even in one instruction (float_to_bf16 takes ~7 a value),
// and writes its canonical 0x7FFF for a NaN, which five integer instructions turn into 0x7FC0
// without a branch: a half is 0x7FFF or 0xFFFF exactly when (half | 0x8000) - 0x7FFF is 0x8000,
// and the conversion never writes 0xFFFF. The element kernels' form (expert_math.h's pairs).
__device__ inline std::uint32_t float_to_bf16x2(float lo, float hi) {
  std::uint32_t w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  const std::uint32_t nan_halves = (((w | 0x80008000u) - 0x7FFF7FFFu) >> 15) & 0x00010001u;
  return w ^ (nan_halves * 0x3Fu);  // 0x7FFF ^ 0x3F = 0x7FC0
}
#endif

}  // namespace mok::core
