// The MXFP8 number format (OCP Microscaling v1.0): E4M3 elements, one E8M0 scale per block of
// 32 elements along the reduction dimension. Integer code only, the same on the host and the
// device, so the CPU and CUDA quantizers give the same bytes.
//
// Scale rules (the block's scale is 2^e, e an integer):
//   RCEIL (default, as MoK and Transformer Engine): the smallest e with amax <= 448 * 2^e, so
//         no element saturates;
//   FLOOR (OCP): e = floor(log2(amax)) - 8; elements above 448 * 2^e saturate to +-448.
// e is clamped to [-127, 127] (E8M0 byte e + 127). A block of zeros gets e = -127 (byte 0x00).
// A block holding a NaN or an infinity gets the NaN scale 0xFF and every element 0x7F with its
// input's sign: it dequantizes to NaN, as a NaN would after any GEMM.
// Elements: x / 2^e rounded to nearest, ties to even, saturating at +-448 (E4M3 "fn": no
// infinities; 0x7F and 0xFF are NaN). The sign of zero is kept.
#pragma once

#include <cstdint>

#include "mok/core/bf16.h"
#include "mok/core/hd.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#include <cuda_fp8.h>
#define MOK_MXFP8_HW_E4M3 1  // the FP8 conversion instruction (sm_89 and later)
#endif

namespace mok::mxfp8 {

inline constexpr int kBlock = 32;                // elements per scale
inline constexpr std::uint8_t kScaleNaN = 0xFF;  // E8M0 NaN
inline constexpr std::uint8_t kE4M3NaN = 0x7F;   // E4M3 NaN (with the sign bit clear)
inline constexpr std::uint8_t kE4M3Max = 0x7E;   // 448
inline constexpr int kMinScaleExponent = -127;

enum class ScaleRule : int { kRceil = 0, kFloor = 1 };

// Position of the highest set bit plus one (0 for 0), by counting leading zeros: one
// instruction, where a loop made the encoder (and every kernel that quantizes) bound by integer
// issue (NOTES.md, session 10).
MOK_HD inline int bit_length(std::uint32_t v) {
#if defined(__CUDA_ARCH__)
  return 32 - __clz(static_cast<int>(v));
#elif defined(__GNUC__) || defined(__clang__)
  return v == 0 ? 0 : 32 - __builtin_clz(v);
#else
  int n = 0;
  while (v != 0) {
    v >>= 1;
    ++n;
  }
  return n;
#endif
}

// |x| = magnitude * 2^exponent with an integer magnitude (< 2^24), for a finite fp32 bit pattern.
struct Magnitude {
  std::uint32_t m;
  int q;
};

MOK_HD inline Magnitude magnitude_of(std::uint32_t bits) {
  const std::uint32_t field = (bits >> 23) & 0xFFu;
  const std::uint32_t frac = bits & 0x7FFFFFu;
  if (field == 0) return {frac, -149};
  return {frac | 0x800000u, static_cast<int>(field) - 150};
}

// The block's scale exponent for a finite amax >= 0 (bits of a non-negative fp32).
MOK_HD inline int scale_exponent(std::uint32_t amax_bits, ScaleRule rule) {
  const Magnitude a = magnitude_of(amax_bits);
  if (a.m == 0) return kMinScaleExponent;
  const int length = bit_length(a.m);
  const int p = length - 1 + a.q;  // amax in [2^p, 2^(p+1))
  int e = p - 8;
  // RCEIL: 448 * 2^(p-8) = 1.75 * 2^p covers amax unless amax > 1.75 * 2^p, i.e.
  // 4 m > 7 * 2^(length-1).
  if (rule == ScaleRule::kRceil && 4ull * a.m > 7ull * (1ull << (length - 1))) {
    e = p - 7;
  }
  return e < kMinScaleExponent ? kMinScaleExponent : (e > 127 ? 127 : e);
}

MOK_HD inline std::uint8_t scale_byte(int e) { return static_cast<std::uint8_t>(e + 127); }

// fp32 value of an E8M0 byte (exact: 2^-127 is an fp32 subnormal); 0xFF -> NaN.
MOK_HD inline float scale_value(std::uint8_t b) {
  if (b == kScaleNaN) return core::bits_float(0x7FC00000u);
  if (b == 0) return core::bits_float(0x00400000u);
  return core::bits_float(static_cast<std::uint32_t>(b) << 23);
}

// Rounds m * 2^-shift to an integer, nearest with ties to even (shift >= 0).
MOK_HD inline std::uint32_t shift_round_even(std::uint32_t m, int shift) {
  if (shift == 0) return m;
  if (shift > 31) return 0;  // m < 2^24: below one half
  const std::uint64_t wide = m;
  const std::uint64_t kept = wide >> shift;
  const std::uint64_t rest = wide & ((1ull << shift) - 1ull);
  const std::uint64_t half = 1ull << (shift - 1);
  const bool up = rest > half || (rest == half && (kept & 1ull) != 0);
  return static_cast<std::uint32_t>(kept + (up ? 1ull : 0ull));
}

// E4M3 byte of x / 2^e for a finite fp32 bit pattern x: nearest even, saturating at 448.
// On sm_89+ devices the conversion instruction (cvt.rn.satfinite.e4m3x2.f32) gives the same byte:
// x * 2^-e is exact in fp32 (a power of two) wherever it can round to a nonzero E4M3 (below
// 2^-126, where it may round or flush, every E4M3 rounding is a zero of x's sign), and the
// instruction rounds to nearest even onto the same grid, subnormals included, saturating at 448.
// tests/test_mxfp8_quantize.py holds the GPU's bytes to an exact-arithmetic reading of the spec.
MOK_HD inline std::uint8_t encode_e4m3(std::uint32_t x_bits, int e) {
#if defined(MOK_MXFP8_HW_E4M3)
  // 2^-e for e in [-127, 127]: a normal fp32, or 2^-127 (a subnormal) at e = 127.
  const float inv = e < 127 ? __uint_as_float(static_cast<std::uint32_t>(127 - e) << 23)
                            : __uint_as_float(0x00400000u);
  const float scaled = __fmul_rn(__uint_as_float(x_bits), inv);
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(scaled, __NV_SATFINITE, __NV_E4M3));
#else
  const std::uint8_t sign = static_cast<std::uint8_t>((x_bits >> 24) & 0x80u);
  const Magnitude a = magnitude_of(x_bits);
  if (a.m == 0) return sign;
  const int q = a.q - e;                  // |x| / 2^e = m * 2^q
  const int p = bit_length(a.m) - 1 + q;  // in [2^p, 2^(p+1))
  const int k = (p > -6 ? p : -6) - 3;    // the E4M3 quantum at that magnitude
  std::uint32_t n;                        // |x| / 2^e ~= n * 2^k, n <= 16
  if (q >= k) {
    n = a.m << (q - k);  // exact: only when m is small enough that n < 16
  } else {
    n = shift_round_even(a.m, k - q);
  }
  int kk = k;
  if (n == 0) return sign;
  if (n == 16) {  // rounding carried into the next binade
    n = 8;
    kk += 1;
  }
  if (n < 8) return static_cast<std::uint8_t>(sign | n);  // subnormal (kk == -9)
  const int field = kk + 10;                              // E4M3 exponent field, bias 7
  if (field > 15 || (field == 15 && n - 8 == 7)) return static_cast<std::uint8_t>(sign | kE4M3Max);
  return static_cast<std::uint8_t>(sign | (field << 3) | (n - 8));
#endif
}

// fp32 value of an E4M3 byte (exact); 0x7F and 0xFF -> NaN.
MOK_HD inline float decode_e4m3(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t field = (b >> 3) & 0xFu;
  const std::uint32_t frac = b & 0x7u;
  if (field == 15 && frac == 7) return core::bits_float(0x7FC00000u);
  if (field == 0) {
    if (frac == 0) return core::bits_float(sign);
    // frac * 2^-9: normalise into fp32 (exponent field = 127 - 9 + (length - 1)).
    const int length = bit_length(frac);
    const std::uint32_t mant = (frac << (24 - length)) & 0x7FFFFFu;
    return core::bits_float(sign | (static_cast<std::uint32_t>(127 - 9 + length - 1) << 23) | mant);
  }
  return core::bits_float(sign | ((field - 7 + 127) << 23) | (frac << 20));
}

MOK_HD inline bool is_finite_bits(std::uint32_t bits) {
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// Unrolls a loop in device code (where `count` is a constant after inlining, the caller's
// element arrays then stay in registers instead of local memory); nothing on the host.
#if defined(__CUDA_ARCH__)
#define MOK_MXFP8_UNROLL _Pragma("unroll")
#else
#define MOK_MXFP8_UNROLL
#endif

// The pieces of a block's quantization, for code that splits a block across threads (the
// CUDA kernel's lanes): the running statistics, then the scale and each element from them.
struct BlockStats {
  std::uint32_t amax = 0;  // largest magnitude's bits (finite magnitudes order as bit patterns)
  bool finite = true;      // no NaN and no infinity in the block

  MOK_HD void add(std::uint32_t bits) {
    finite = finite && is_finite_bits(bits);
    const std::uint32_t mag = bits & 0x7FFFFFFFu;
    amax = mag > amax ? mag : amax;
  }
  MOK_HD void merge(BlockStats o) {
    finite = finite && o.finite;
    amax = o.amax > amax ? o.amax : amax;
  }
  // The scale exponent (meaningful for a finite block) and the scale byte.
  MOK_HD int exponent(ScaleRule rule) const { return finite ? scale_exponent(amax, rule) : 0; }
  MOK_HD std::uint8_t scale(int e) const { return finite ? scale_byte(e) : kScaleNaN; }
  // An element's byte: x / 2^e, or NaN with x's sign in a non-finite block.
  MOK_HD std::uint8_t element(std::uint32_t bits, int e) const {
    return finite ? encode_e4m3(bits, e)
                  : static_cast<std::uint8_t>(((bits >> 24) & 0x80u) | kE4M3NaN);
  }
};

// Quantizes one block of `count` (<= 32) fp32 bit patterns, read as load(i); writes store(i, byte)
// and returns the scale byte. Elements past `count` are not read (the caller pads with zeros).
template <typename Load, typename Store>
MOK_HD inline std::uint8_t quantize_block(int count, ScaleRule rule, const Load& load,
                                          const Store& store) {
  BlockStats stats;
  MOK_MXFP8_UNROLL
  for (int i = 0; i < count; ++i) stats.add(load(i));
  const int e = stats.exponent(rule);
  MOK_MXFP8_UNROLL
  for (int i = 0; i < count; ++i) store(i, stats.element(load(i), e));
  return stats.scale(e);
}

}  // namespace mok::mxfp8
