// CUDA combine epilogue (docs/core-runtime.md "Epilogue"): bitwise the CPU loop, because both
// run combine_step of mok/core/epilogue.h (__fmul_rn then __fadd_rn: nvcc cannot contract
// them into an FMA) and the integer bf16 conversions of mok/core/bf16.h.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "epilogue_impl.h"
#include "mok/core/epilogue.h"

namespace mok::core {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;    // bf16 per 16-byte access
constexpr int kChunk = 4;  // routes whose rows one thread loads before adding them

struct CombineParams {
  std::uint16_t* out;
  const std::uint16_t* base;
  const std::uint16_t* rows;
  const float* weights;
  const std::int32_t* row_index;  // or null
  std::int64_t num_rows;
  std::int64_t num_tokens;
  std::int64_t topk;
  std::int64_t hidden;
  const std::int32_t* error;  // or null (then error_mirror is null too)
  std::int32_t* error_mirror;
};

__device__ __forceinline__ void unpack(const uint4& v, std::uint16_t (&x)[kVec]) {
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = static_cast<std::uint16_t>(words[i] & 0xFFFFu);  // little-endian: lower h first
    x[2 * i + 1] = static_cast<std::uint16_t>(words[i] >> 16);
  }
}

// One thread per (token t, kVec consecutive h), grid-stride. Each element's sum runs k
// ascending in one thread, in registers, so nothing depends on the launch shape.
//   kAligned: H % 8 == 0 and every pointer 16-byte aligned, so base, each row and out move as
//   one 16-byte access per thread (rows through the read-only path); otherwise element-wise.
// Reads of `base` use plain loads: out may alias base (in place), each element read by the
// thread that then writes it.
template <bool kAligned>
__global__ void __launch_bounds__(kThreads) combine_bf16_kernel(CombineParams p) {
  if (p.error_mirror != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    // The error words as every earlier kernel of the stream left them, to the host's mirror.
    for (int i = 0; i < static_cast<int>(kErrorMirrorBytes / 4); ++i) {
      static_cast<volatile std::int32_t*>(p.error_mirror)[i] = p.error[i];
    }
  }
  const std::int64_t groups = (p.hidden + kVec - 1) / kVec;
  const std::int64_t total = p.num_tokens * groups;
  const bool weighted = p.weights != nullptr;
  for (std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < total;
       g += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    // 32-bit division where it fits (every realistic shape): the 64-bit one is a long routine.
    const std::int64_t t =
        total <= UINT32_MAX ? static_cast<unsigned>(g) / static_cast<unsigned>(groups) : g / groups;
    const std::int64_t h0 = (g - t * groups) * kVec;
    if constexpr (kAligned) {
      float acc[kVec];
      if (p.base != nullptr) {
        std::uint16_t b[kVec];
        unpack(*reinterpret_cast<const uint4*>(p.base + t * p.hidden + h0), b);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = bf16_to_float(b[i]);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
      }
      // The routes in chunks of kChunk: every row of a chunk is asked for before the first is
      // added (the loads overlap: one thread's row loads were one round trip each), then they
      // are added in k order, as always.
      for (std::int64_t k0 = 0; k0 < p.topk; k0 += kChunk) {
        uint4 v[kChunk];
        float w[kChunk];
        bool live[kChunk];
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          const std::int64_t route = t * p.topk + k0 + c;
          const std::int64_t row =
              k0 + c < p.topk ? combine_row(route, p.row_index, p.num_rows) : -1;
          live[c] = row >= 0;
          w[c] = live[c] && weighted ? __ldg(p.weights + route) : 1.0f;
          v[c] = live[c] ? __ldg(reinterpret_cast<const uint4*>(p.rows + row * p.hidden + h0))
                         : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          if (!live[c]) continue;
          std::uint16_t r[kVec];
          unpack(v[c], r);
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[i] = combine_step(acc[i], r[i], weighted, w[c]);
        }
      }
      unsigned words[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        words[i] = static_cast<unsigned>(float_to_bf16(acc[2 * i])) |
                   (static_cast<unsigned>(float_to_bf16(acc[2 * i + 1])) << 16);
      }
      *reinterpret_cast<uint4*>(p.out + t * p.hidden + h0) =
          make_uint4(words[0], words[1], words[2], words[3]);
    } else {
      const std::int64_t h_end = h0 + kVec < p.hidden ? h0 + kVec : p.hidden;
      for (std::int64_t h = h0; h < h_end; ++h) {
        p.out[t * p.hidden + h] = combine_element(p.base, p.rows, p.weights, p.row_index,
                                                  p.num_rows, t, h, p.topk, p.hidden);
      }
    }
  }
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status));
  }
}

bool aligned16(std::uintptr_t ptr) { return ptr % 16 == 0; }

// How many CTAs of `kernel` the current device holds at once (SMs x CTAs per SM), read from the
// driver once per device. The combine's grid is at most that: every CTA resident, the grid-stride
// loop spreading the work evenly. A grid of several waves ended in a partial one (at sonic-7b 2,112
// CTAs where 660 fit on an H100: a last wave of one CTA an SM); measured 0-4 % faster at K = 8,
// 1-5 % slower at K = 2 (NOTES.md, session 37).
constexpr int kTrackedDevices = 64;

template <bool kAligned>
int resident_ctas() {
  static std::atomic<int> known[kTrackedDevices];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const bool tracked = device >= 0 && device < kTrackedDevices;
  if (tracked) {
    if (const int n = known[device].load(std::memory_order_relaxed); n > 0) return n;
  }
  int num_sms = 0;
  int per_sm = 0;
  check_cuda(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(MultiProcessorCount)");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, combine_bf16_kernel<kAligned>,
                                                           kThreads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const int n = num_sms * (per_sm > 0 ? per_sm : 1);
  if (tracked) known[device].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace

void combine_cuda(const CombineArgs& a, std::uintptr_t stream_handle) {
  CombineParams p;
  p.out = reinterpret_cast<std::uint16_t*>(a.out);
  p.base = reinterpret_cast<const std::uint16_t*>(a.base);
  p.rows = reinterpret_cast<const std::uint16_t*>(a.rows);
  p.weights = reinterpret_cast<const float*>(a.weights);
  p.row_index = reinterpret_cast<const std::int32_t*>(a.row_index);
  p.num_rows = a.num_rows;
  p.num_tokens = a.num_tokens;
  p.topk = a.topk;
  p.hidden = a.hidden;
  p.error = reinterpret_cast<const std::int32_t*>(a.error);
  p.error_mirror = reinterpret_cast<std::int32_t*>(a.error_mirror);

  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const bool vec = a.hidden % kVec == 0 && aligned16(a.out) && aligned16(a.rows) &&
                   (a.base == 0 || aligned16(a.base));
  const std::int64_t work = a.num_tokens * ((a.hidden + kVec - 1) / kVec);
  const std::int64_t wanted = (work + kThreads - 1) / kThreads;
  const std::int64_t cap = vec ? resident_ctas<true>() : resident_ctas<false>();
  const unsigned blocks = static_cast<unsigned>(wanted < cap ? wanted : cap);
  if (vec) {
    combine_bf16_kernel<true><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    combine_bf16_kernel<false><<<blocks, kThreads, 0, stream>>>(p);
  }
  check_cuda(cudaGetLastError(), "combine_bf16_kernel launch");
}

void publish_error_cuda(const CombineArgs& a, std::uintptr_t stream_handle) {
  check_cuda(cudaMemcpyAsync(reinterpret_cast<void*>(a.error_mirror),
                             reinterpret_cast<const void*>(a.error), kErrorMirrorBytes,
                             cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream_handle)),
             "cudaMemcpyAsync of the error words");
}

}  // namespace mok::core
