// Arithmetic with exactly one rounding per operation, on the host and the device alike.
//
// nvcc may contract a * b + c into a fused multiply-add, which rounds once instead of twice
// and changes bits; the __f*_rn / __d*_rn intrinsics forbid it on the device. Host code is
// compiled with -ffp-contract=off (mok_configure_target). Everything that must give the same
// bits on the CPU and the GPU (the epilogues, the reference arithmetic of the experts) uses
// these.
#pragma once

#include "mok/core/hd.h"

namespace mok::core {

MOK_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MOK_HD inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MOK_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MOK_HD inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

MOK_HD inline double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

MOK_HD inline double sub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}

MOK_HD inline double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace mok::core
