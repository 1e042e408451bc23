// The per-element arithmetic of the experts (docs/design.md §2, docs/determinism.md "The reference
// backend's arithmetic"), shared by every precision package's CPU loops and CUDA kernels, so
// that all give the bits of mok-torch's reference backend
// (mok_torch/spec/arith.py and experts.py).
//
// Every operation rounds on its own, in the order the reference writes it: a product before
// the add that follows it, never a fused multiply-add. On the device the __f*_rn/__d*_rn
// intrinsics forbid nvcc's contraction; host code must be compiled with -ffp-contract=off
// (mok_configure_target sets it). In the GEMM and weight-gradient reductions both operands
// are bf16 values, so the product is exact and an FMA would give the same bits; every other
// product (w * g, silu * b, the float64 polynomial of exp, ...) is not, and there it matters.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mok/core/bf16.h"
#include "mok/core/hd.h"
#include "mok/core/rounding.h"

namespace mok::core {

// One step of a sequential reduction: acc + fl(a * b).
MOK_HD inline float mac_rn(float acc, float a, float b) { return add_rn(acc, mul_rn(a, b)); }

// ------------------------------------------------------------------ exp and sigmoid

// exp(x) in float64 exactly as the reference's exp_f64: Cody-Waite reduction by ln 2 and a
// degree-13 Taylor polynomial, from +, -, * and exponent bits only (libm, SLEEF and CUDA exp
// differ in the last bit). NaN passes through; beyond +-700 the result is inf or 0.
MOK_HD inline double exp_f64(double x) {
  constexpr double kClamp = 700.0;
  constexpr double kInvLn2 = 1.4426950408889634;
  // n * kLn2Hi is exact for |n| < 2**11.
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  if (x != x) return x;
  if (x > kClamp) return INFINITY;
  if (x < -kClamp) return 0.0;
  // Nearest integer, ties to even (torch.round); the default rounding mode is to nearest.
#if defined(__CUDA_ARCH__)
  const double n = rint(mul_rn(x, kInvLn2));
#else
  const double n = std::nearbyint(mul_rn(x, kInvLn2));
#endif
  const double r = sub_rn(sub_rn(x, mul_rn(n, kLn2Hi)), mul_rn(n, kLn2Lo));
  // Horner with the coefficients 1/k! for k = 13..0, each step p = fl(fl(p * r) + c); the
  // literals are the reference's `1.0 / math.factorial(k)`, correctly rounded alike.
  double p = 1.0 / 6227020800.0;                // 1/13!
  p = add_rn(mul_rn(p, r), 1.0 / 479001600.0);  // 1/12!
  p = add_rn(mul_rn(p, r), 1.0 / 39916800.0);   // 1/11!
  p = add_rn(mul_rn(p, r), 1.0 / 3628800.0);    // 1/10!
  p = add_rn(mul_rn(p, r), 1.0 / 362880.0);     // 1/9!
  p = add_rn(mul_rn(p, r), 1.0 / 40320.0);      // 1/8!
  p = add_rn(mul_rn(p, r), 1.0 / 5040.0);       // 1/7!
  p = add_rn(mul_rn(p, r), 1.0 / 720.0);        // 1/6!
  p = add_rn(mul_rn(p, r), 1.0 / 120.0);        // 1/5!
  p = add_rn(mul_rn(p, r), 1.0 / 24.0);         // 1/4!
  p = add_rn(mul_rn(p, r), 1.0 / 6.0);          // 1/3!
  p = add_rn(mul_rn(p, r), 1.0 / 2.0);          // 1/2!
  p = add_rn(mul_rn(p, r), 1.0);                // 1/1!
  p = add_rn(mul_rn(p, r), 1.0);                // 1/0!
  // 2**n from its exponent bits: |n| <= 1010 keeps it a normal number.
  const std::int64_t bits = (static_cast<std::int64_t>(n) + 1023) << 52;
#if defined(__CUDA_ARCH__)
  const double two_n = __longlong_as_double(bits);
#else
  double two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
#endif
  return mul_rn(p, two_n);
}

// sigmoid(a) = fp32(1 / (1 + exp(-a))) computed in float64 and rounded once, as the reference.
MOK_HD inline float sigmoid(float a) {
  const double s = div_rn(1.0, add_rn(1.0, exp_f64(-static_cast<double>(a))));
#if defined(__CUDA_ARCH__)
  return __double2float_rn(s);
#else
  return static_cast<float>(s);
#endif
}

// core::sigmoid as a function object: the default of the element functions below.
struct Sigmoid {
  MOK_HD float operator()(float a) const { return sigmoid(a); }
};

// ------------------------------------------------------------------ SwiGLU

// The optional gpt-oss clamp `a <= limit`, `-limit <= b <= limit`. The limit is used as an
// fp32 value: torch compares and clamps an fp32 tensor against a Python float in fp32.
struct SwigluLimit {
  bool on = false;
  float limit = 0.0f;
};

// min(a, limit), NaN passing through (torch.clamp).
MOK_HD inline float clamp_gate(float a, SwigluLimit lim) {
  return lim.on && a > lim.limit ? lim.limit : a;
}

// clamp(b, -limit, limit), NaN passing through (torch.clamp).
MOK_HD inline float clamp_up(float b, SwigluLimit lim) {
  if (!lim.on) return b;
  if (b < -lim.limit) return -lim.limit;
  return b > lim.limit ? lim.limit : b;
}

// h = bf16((a_c * sigmoid(a_c)) * b_c): the forward activation of one element. `sig` returns
// sigmoid(a_c): core::sigmoid by default, or a kernel's lookup of the same bits
// (sigmoid_table.cuh); whichever it is, the bits of h do not change.
template <class Sig = Sigmoid>
MOK_HD inline std::uint16_t swiglu_h(std::uint16_t a, std::uint16_t b, SwigluLimit lim,
                                     const Sig& sig = Sig{}) {
  const float af = clamp_gate(bf16_to_float(a), lim);
  const float bf = clamp_up(bf16_to_float(b), lim);
  return float_to_bf16(mul_rn(mul_rn(af, sig(af)), bf));
}

// The SwiGLU backward of one element i of a row.
struct SwigluGrad {
  float h;            // fp32(h), h recomputed as in the forward (bf16 value)
  std::uint16_t d_a;  // bf16 gradient of the pre-activation a
  std::uint16_t d_b;  // bf16 gradient of the pre-activation b
};

// g: the unweighted down-projection input gradient (dy @ Wd)[i]; w: the row's router weight
// (1 for an unweighted row: w * g is then exactly g). The router-weight gradient of the row is
// the sequential sum over i of fl(g * h), which the caller accumulates.
//
//   d_h = w * g;  d_silu = s * (1 + a_c * (1 - s));  d_a = (d_h * b_c) * d_silu;
//   d_b = d_h * silu;  zero where the clamp bit (a > limit, |b| > limit, or NaN)
template <class Sig = Sigmoid>
MOK_HD inline SwigluGrad swiglu_backward(float g, float w, std::uint16_t a, std::uint16_t b,
                                         SwigluLimit lim, const Sig& sig = Sig{}) {
  const float a_raw = bf16_to_float(a);
  const float b_raw = bf16_to_float(b);
  const float af = clamp_gate(a_raw, lim);
  const float bf = clamp_up(b_raw, lim);
  const float s = sig(af);
  const float silu = mul_rn(af, s);
  const float h = bf16_to_float(float_to_bf16(mul_rn(silu, bf)));
  const float d_h = mul_rn(w, g);
  const float d_silu = mul_rn(s, add_rn(1.0f, mul_rn(af, sub_rn(1.0f, s))));
  float d_a = mul_rn(mul_rn(d_h, bf), d_silu);
  float d_b = mul_rn(d_h, silu);
  if (lim.on) {
    // The clamp passes gradient only where it did not bite (a comparison with NaN is false).
    if (!(a_raw <= lim.limit)) d_a = 0.0f;
    if (!((b_raw < 0.0f ? -b_raw : b_raw) <= lim.limit)) d_b = 0.0f;
  }
  return {h, float_to_bf16(d_a), float_to_bf16(d_b)};
}

#if defined(__CUDACC__)
// ------------------------------------------------------------------ pair forms (device)
// The kernels' form of swiglu_h and swiglu_backward: two adjacent elements, a, b and the
// bf16 results two to a 32-bit word (the lower half first), each rounding of the pair by
// float_to_bf16x2 (one instruction, not ~14): every operation the scalar functions do, in their
// order, so the same bits. A caller that knows the clamp is off passes SwigluLimit{} as a
// constant (its `on` false: with_swiglu_limit), and the compiler drops the clamps and their tests.

// f(lim), with the clamp passed as the constant SwigluLimit{} where it is off: a branch the warp
// takes as one, and on that side the compiler drops the clamps and their tests from f's element
// math. The kernels' one way to specialize for the clamp.
template <class F>
__device__ inline auto with_swiglu_limit(SwigluLimit lim, F&& f) {
  return lim.on ? f(lim) : f(SwigluLimit{});
}

// h of two elements whose sigmoids s0, s1 (of the clamped gates) were looked up.
__device__ inline std::uint32_t swiglu_h2(std::uint32_t a2, std::uint32_t b2, SwigluLimit lim,
                                          float s0, float s1) {
  const float a0 = clamp_gate(bf16_to_float(static_cast<std::uint16_t>(a2)), lim);
  const float a1 = clamp_gate(bf16_to_float(static_cast<std::uint16_t>(a2 >> 16)), lim);
  const float b0 = clamp_up(bf16_to_float(static_cast<std::uint16_t>(b2)), lim);
  const float b1 = clamp_up(bf16_to_float(static_cast<std::uint16_t>(b2 >> 16)), lim);
  return float_to_bf16x2(mul_rn(mul_rn(a0, s0), b0), mul_rn(mul_rn(a1, s1), b1));
}

// swiglu_backward of two elements: h as fp32 values, d_a and d_b packed.
struct SwigluGrad2 {
  float h[2];
  std::uint32_t d_a;
  std::uint32_t d_b;
};

template <class Sig>
__device__ inline SwigluGrad2 swiglu_backward2(float g0, float g1, float w, std::uint32_t a2,
                                               std::uint32_t b2, SwigluLimit lim, const Sig& sig) {
  float hp[2], da[2], db[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float a_raw = bf16_to_float(static_cast<std::uint16_t>(a2 >> (16 * e)));
    const float b_raw = bf16_to_float(static_cast<std::uint16_t>(b2 >> (16 * e)));
    const float af = clamp_gate(a_raw, lim);
    const float bf = clamp_up(b_raw, lim);
    const float s = sig(af);
    const float silu = mul_rn(af, s);
    hp[e] = mul_rn(silu, bf);
    const float d_h = mul_rn(w, e == 0 ? g0 : g1);
    const float d_silu = mul_rn(s, add_rn(1.0f, mul_rn(af, sub_rn(1.0f, s))));
    da[e] = mul_rn(mul_rn(d_h, bf), d_silu);
    db[e] = mul_rn(d_h, silu);
    if (lim.on) {
      if (!(a_raw <= lim.limit)) da[e] = 0.0f;
      if (!((b_raw < 0.0f ? -b_raw : b_raw) <= lim.limit)) db[e] = 0.0f;
    }
  }
  const std::uint32_t h2 = float_to_bf16x2(hp[0], hp[1]);
  return {{bits_float(h2 << 16), bits_float(h2 & 0xFFFF0000u)},
          float_to_bf16x2(da[0], da[1]),
          float_to_bf16x2(db[0], db[1])};
}

// weighted_bf16 of two values of h: bf16(w * h), packed.
__device__ inline std::uint32_t weighted_bf16x2(float w, float h0, float h1) {
  return float_to_bf16x2(mul_rn(w, h0), mul_rn(w, h1));
}

// The SwiGLU backward of eight adjacent elements of a row (16 bytes of a and of b, their fp32 g
// in g8, the row's weight w): hw = bf16(w h), d_a and d_b out, 16 bytes each, and fl(g_i h_i)
// added to `part` in column order (a lane's share of d_w), returned. The SwiGLU kernel's and the
// fused g kernel's piece.
template <class Sig>
__device__ inline float swiglu_backward8(const float (&g8)[8], float w, const uint4& av,
                                         const uint4& bv, SwigluLimit lim, const Sig& sig,
                                         float part, uint4& hw, uint4& d_a, uint4& d_b) {
  const std::uint32_t aw[4] = {av.x, av.y, av.z, av.w};
  const std::uint32_t bw[4] = {bv.x, bv.y, bv.z, bv.w};
  std::uint32_t hv[4], dav[4], dbv[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const SwigluGrad2 grad = swiglu_backward2(g8[2 * q], g8[2 * q + 1], w, aw[q], bw[q], lim, sig);
    part = mac_rn(part, g8[2 * q], grad.h[0]);
    part = mac_rn(part, g8[2 * q + 1], grad.h[1]);
    hv[q] = weighted_bf16x2(w, grad.h[0], grad.h[1]);
    dav[q] = grad.d_a;
    dbv[q] = grad.d_b;
  }
  hw = make_uint4(hv[0], hv[1], hv[2], hv[3]);
  d_a = make_uint4(dav[0], dav[1], dav[2], dav[3]);
  d_b = make_uint4(dbv[0], dbv[1], dbv[2], dbv[3]);
  return part;
}
#endif

// bf16(w * dy): the down-projection weight gradient's left operand, rounded to bf16 as the
// kernels feed it to the tensor cores (w = 1 leaves dy unchanged).
MOK_HD inline std::uint16_t weighted_bf16(float w, float dy) {
  return float_to_bf16(mul_rn(w, dy));
}

}  // namespace mok::core
