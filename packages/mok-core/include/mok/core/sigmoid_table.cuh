// sigmoid(a) for every bf16 a, as a table in device memory: the SwiGLU kernels' element math
// without its float64 cost. CUDA code: include it from .cu files.
//
// The reference's sigmoid (expert_math.h) is a float64 exp and a float64 division, rounded once
// to fp32: ~50 float64 instructions per element, which bound the SwiGLU kernels (h, the
// backward's d_a and d_b) by the H200's float64 rate, not its memory. Its argument is the gate's
// bf16 value (clamped: then the fp32 limit), so it takes at most 65,536 + 1 values: a kernel
// computes them once per device with core::sigmoid itself, and the SwiGLU kernels look them up.
// The bits cannot change: an entry is the same function of the same input on the same hardware.
// The one argument that is not a bf16 value (the clamp's limit) is computed once per call.
//
// Every translation unit that includes this header has its own table (internal linkage), made
// by its first call of ensure_sigmoid_table on each device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "mok/core/bf16.h"
#include "mok/core/expert_math.h"

namespace mok::core {
namespace {

inline constexpr int kSigmoidTableDevices = 64;

__device__ float g_sigmoid_table[1 << 16];

__global__ void fill_sigmoid_table_kernel() {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (1 << 16)) g_sigmoid_table[i] = sigmoid(bf16_to_float(static_cast<std::uint16_t>(i)));
}

// The lookup, as the `sig` argument of swiglu_h and swiglu_backward, whose argument is the
// clamped gate: a bf16 value, or the clamp's limit. The limit's sigmoid is computed once per
// thread by of(), so the element code holds no float64 math (inlined at every element of an
// unrolled GEMM epilogue, that code tripled the kernels' size and their instruction fetch
// stalled the tensor cores: NOTES.md, session 8).
// A read-only (non-coherent) load: the table does not change while a kernel reads it, and the
// compiler may issue the lookups ahead of the caller's stores.
struct TableSigmoid {
  float at_limit;  // sigmoid(limit): the one argument that is not a bf16 value

  MOK_HD static TableSigmoid of(SwigluLimit lim) { return {lim.on ? sigmoid(lim.limit) : 0.0f}; }

  __device__ float operator()(float a) const {
    const std::uint32_t bits = __float_as_uint(a);
    if ((bits & 0xFFFFu) != 0) return at_limit;  // not a bf16 value: the clamp's limit
    return __ldg(&g_sigmoid_table[bits >> 16]);
  }
};

// The table's entries of the gates that occur, copied into a kernel's shared memory (20 KB) so
// that an epilogue's lookups do not go to L2 one element at a time: the fused g GEMM's SwiGLU
// backward, whose shared memory leaves the L1 too small for the table's hot part (NOTES.md,
// session 49: the lookups cost that kernel ~280 us at sonic-7b on an H100). Gates with |a| in
// [2^-16, 16), either sign (bf16 bits of |a|); the others (about one in 10^5 of normally
// distributed gates, and NaN and infinities) are read from the table in device memory, so every
// value is the table's whatever the ranges (they decide only where it is read from).
struct SharedSigmoid {
  static constexpr std::uint32_t kPosLo = 0x3780, kPosEnd = 0x4180;  // 2^-16, 16
  static constexpr std::uint32_t kNegLo = 0x3780, kNegEnd = 0x4180;
  static constexpr int kPos = static_cast<int>(kPosEnd - kPosLo);
  static constexpr int kEntries = kPos + static_cast<int>(kNegEnd - kNegLo);

  const float* shared;  // kEntries floats, filled by fill()
  float at_limit;       // sigmoid(limit), as TableSigmoid's

  // The entries into `shared` by threads tid = 0 .. threads - 1 of the CTA (the caller then
  // synchronizes the CTA before any lookup).
  __device__ static void fill(float* shared, int tid, int threads) {
    for (int i = tid; i < kEntries; i += threads) {
      const std::uint32_t bits = i < kPos ? kPosLo + i : 0x8000u | (kNegLo + (i - kPos));
      shared[i] = __ldg(&g_sigmoid_table[bits]);
    }
  }
  __device__ float operator()(float a) const {
    const std::uint32_t bits = __float_as_uint(a);
    if ((bits & 0xFFFFu) != 0) return at_limit;  // not a bf16 value: the clamp's limit
    const std::uint32_t u = bits >> 16, mag = u & 0x7FFFu;
    const bool neg = (u & 0x8000u) != 0;
    const std::uint32_t i = neg ? mag - kNegLo : mag - kPosLo;  // wraps below the range
    if (i < (neg ? kNegEnd - kNegLo : kPosEnd - kPosLo)) return shared[neg ? kPos + i : i];
    return __ldg(&g_sigmoid_table[u]);
  }
};

// The sigmoids of eight elements' clamped gates (16 bytes of a: bf16 values two to a 32-bit word,
// the lower half first), looked up: all that swiglu_h8 needs of the table. A caller with several
// vectors looks up every vector's sigmoids before it computes and stores any (one round trip to the
// table for all of them): the compiler does not move a vector's lookups above the stores before it,
// so lookups interleaved with stores wait for the L2 once a vector (NOTES.md, session 29).
struct Sigmoid8 {
  float s[8];  // element e: half e % 2 of word e / 2
};

// Half `half` of a 32-bit word of two bf16 values (0: the lower, the first element).
__device__ inline std::uint16_t bf16_half(std::uint32_t w, int half) {
  return static_cast<std::uint16_t>(half == 0 ? w & 0xFFFFu : w >> 16);
}

__device__ inline Sigmoid8 gate_sigmoids8(const uint4& a, SwigluLimit lim,
                                          const TableSigmoid& sig) {
  const std::uint32_t aw[4] = {a.x, a.y, a.z, a.w};
  Sigmoid8 out;
#pragma unroll
  for (int e = 0; e < 8; ++e)
    out.s[e] = sig(clamp_gate(bf16_to_float(bf16_half(aw[e / 2], e % 2)), lim));
  return out;
}

// h = swiglu_h(a, b) of eight elements whose sigmoids were looked up (gate_sigmoids8 of the same
// a): core::swiglu_h's element math in its pair form (swiglu_h2), so the same bits. 16 bytes of
// a, of b and of h.
__device__ inline uint4 swiglu_h8(const uint4& a, const uint4& b, SwigluLimit lim,
                                  const Sigmoid8& sig) {
  return make_uint4(
      swiglu_h2(a.x, b.x, lim, sig.s[0], sig.s[1]), swiglu_h2(a.y, b.y, lim, sig.s[2], sig.s[3]),
      swiglu_h2(a.z, b.z, lim, sig.s[4], sig.s[5]), swiglu_h2(a.w, b.w, lim, sig.s[6], sig.s[7]));
}

// h of eight elements, the lookups included: the SwiGLU kernels' and the FP8 GEMMs' vectors.
__device__ inline uint4 swiglu_h8(const uint4& a, const uint4& b, SwigluLimit lim,
                                  const TableSigmoid& sig) {
  return swiglu_h8(a, b, lim, gate_sigmoids8(a, lim, sig));
}

// Makes this translation unit's table on the current device before `stream`'s next kernel.
// The first call on a device fills it and waits for that (once); a call while `stream` is being
// captured into a CUDA graph puts the fill into the graph instead (every capture: it costs a few
// microseconds) and leaves the device unmarked, so an eager call still fills it.
inline void ensure_sigmoid_table(cudaStream_t stream) {
  static std::atomic<bool> ready[kSigmoidTableDevices];
  const auto check = [](cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("mok: sigmoid table: ") + what + ": " +
                               cudaGetErrorString(err));
    }
  };
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const bool tracked = device >= 0 && device < kSigmoidTableDevices;
  if (tracked && ready[device].load(std::memory_order_acquire)) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  fill_sigmoid_table_kernel<<<(1 << 16) / 256, 256, 0, stream>>>();
  check(cudaGetLastError(), "launching the fill");
  if (capture != cudaStreamCaptureStatusNone || !tracked) return;
  check(cudaStreamSynchronize(stream), "waiting for the fill");
  ready[device].store(true, std::memory_order_release);
}

}  // namespace
}  // namespace mok::core
