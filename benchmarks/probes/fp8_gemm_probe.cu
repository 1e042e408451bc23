// A probe of mok-mxfp8's FP8 grouped GEMM (cuda/sm90/fp8_gemm.cuh): the gate+up GEMM of one shape
// timed in its production form and in the measurement variants (kProbe, wrong results), to
// find what limits it. Not part of any package; NOTES.md records what it showed.
//
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -Ipackages/mok-mxfp8/include \
//     -Ipackages/mok-core/include -Ipackages/mok-mxfp8/cuda/sm90 -DMOK_WITH_CUDA=1 \
//     benchmarks/probes/fp8_gemm_probe.cu -o probe && ./probe [rows H I experts]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fp8_gemm.cuh"
#include "mok/core/bf16.h"

using namespace mok;
using mxfp8::gemm::Accumulators;
using mxfp8::gemm::BLoad;

#define CHECK(x)                                                                           \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

struct Sink {  // the gate+up epilogue's stores (a and b in bf16)
  std::uint16_t* a;
  std::uint16_t* b;
  int inner;
  __device__ void operator()(const tiles::Tile& tile, int consumer, const Accumulators& acc) const {
    tiles::for_each_pair<64>(tile, consumer, inner, [&](std::int64_t row, int col, int q) {
      const std::int64_t at = row * inner + col;
      const auto pair = [](float lo, float hi) {
        return static_cast<std::uint32_t>(core::float_to_bf16(lo)) |
               (static_cast<std::uint32_t>(core::float_to_bf16(hi)) << 16);
      };
      *reinterpret_cast<std::uint32_t*>(a + at) = pair(acc.d[q], acc.d[q + 1]);
      *reinterpret_cast<std::uint32_t*>(b + at) = pair(acc.d[32 + q], acc.d[32 + q + 1]);
    });
  }
};

template <int kProbe>
float run(const CUtensorMap& ma, const CUtensorMap& mg, const CUtensorMap& mu,
          const tiles::Problem& p, const mxfp8::gemm::Scales& sc, const Sink& sink, int sms) {
  using R = mxfp8::gemm::Ring<mxfp8::gemm::kStages>;
  auto* k =
      mxfp8::gemm::fp8_grouped_gemm_kernel<BLoad::kPaired, mxfp8::gemm::kStages, Sink, kProbe>;
  CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, R::kSharedBytes));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  for (int w = 0; w < 3; ++w)
    k<<<sms, mxfp8::gemm::kThreads, R::kSharedBytes>>>(ma, mg, mu, p, sc, sink);
  CHECK(cudaEventRecord(t0));
  const int iters = 10;
  for (int w = 0; w < iters; ++w)
    k<<<sms, mxfp8::gemm::kThreads, R::kSharedBytes>>>(ma, mg, mu, p, sc, sink);
  CHECK(cudaEventRecord(t1));
  CHECK(cudaEventSynchronize(t1));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  return ms / iters;
}

int main(int argc, char** argv) {
  const long M = argc > 1 ? std::atol(argv[1]) : 16384;
  const long H = argc > 2 ? std::atol(argv[2]) : 7168;
  const long I = argc > 3 ? std::atol(argv[3]) : 2048;
  const long El = argc > 4 ? std::atol(argv[4]) : 8;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const long row_bytes = 2 * H;
  std::vector<std::uint8_t> host(M * row_bytes);
  for (auto& v : host) v = static_cast<std::uint8_t>(std::rand() % 0x70);  // finite E4M3 bytes
  for (long r = 0; r < M; ++r)
    for (long j = 0; j < H / 32; ++j) host[r * row_bytes + H + j] = 120 + std::rand() % 8;
  std::uint8_t *x, *wg, *wu, *sg, *su;
  std::uint16_t *a, *b;
  std::int64_t* offsets;
  CHECK(cudaMalloc(&x, M * row_bytes));
  CHECK(cudaMemcpy(x, host.data(), M * row_bytes, cudaMemcpyHostToDevice));
  std::vector<std::uint8_t> w(El * I * H);
  for (auto& v : w) v = static_cast<std::uint8_t>(std::rand() % 0x70);
  std::vector<std::uint8_t> s(El * I * H / 32);
  for (auto& v : s) v = 120 + std::rand() % 8;
  for (auto** d : {&wg, &wu}) {
    CHECK(cudaMalloc(d, w.size()));
    CHECK(cudaMemcpy(*d, w.data(), w.size(), cudaMemcpyHostToDevice));
  }
  for (auto** d : {&sg, &su}) {
    CHECK(cudaMalloc(d, s.size()));
    CHECK(cudaMemcpy(*d, s.data(), s.size(), cudaMemcpyHostToDevice));
  }
  CHECK(cudaMalloc(&a, M * I * 2));
  CHECK(cudaMalloc(&b, M * I * 2));
  std::vector<std::int64_t> off(El + 1);
  for (long e = 0; e <= El; ++e) off[e] = M * e / El;
  CHECK(cudaMalloc(&offsets, off.size() * 8));
  CHECK(cudaMemcpy(offsets, off.data(), off.size() * 8, cudaMemcpyHostToDevice));

  using hopper::MapType;
  const CUtensorMap ma = hopper::make_tensor_map(x, M, H, 128, MapType::kU8, row_bytes);
  const CUtensorMap mg = hopper::make_tensor_map(wg, El * I, H, 64, MapType::kU8);
  const CUtensorMap mu = hopper::make_tensor_map(wu, El * I, H, 64, MapType::kU8);
  const tiles::Problem p{offsets, M, static_cast<int>(El), static_cast<int>(I),
                         static_cast<int>(H)};
  const mxfp8::gemm::Scales sc{x + H, row_bytes, sg, su};
  const Sink sink{a, b, static_cast<int>(I)};
  const double flops = 4.0 * M * H * I;
  std::printf("fp8 gate+up probe: M %ld H %ld I %ld El %ld, %d SMs\n", M, H, I, El, sms);
  const auto show = [&](const char* name, float ms) {
    std::printf("  %-16s %8.3f ms %7.0f TFLOP/s\n", name, ms, flops / (ms * 1e-3) / 1e12);
    std::fflush(stdout);
  };
  show("production", run<0>(ma, mg, mu, p, sc, sink, sms));
  show("unscaled add", run<1>(ma, mg, mu, p, sc, sink, sms));
  show("no conversion", run<2>(ma, mg, mu, p, sc, sink, sms));
  show("scale per 128", run<3>(ma, mg, mu, p, sc, sink, sms));
  show("no wgmma", run<4>(ma, mg, mu, p, sc, sink, sms));
  show("no scale copies", run<5>(ma, mg, mu, p, sc, sink, sms));
  show("bf16-like", run<6>(ma, mg, mu, p, sc, sink, sms));
  show("stagger 300", run<7>(ma, mg, mu, p, sc, sink, sms));
  show("stagger 700", run<8>(ma, mg, mu, p, sc, sink, sms));
  return 0;
}
