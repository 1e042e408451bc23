// The CPU implementation of the MXFP8 experts (mok/mxfp8/experts.h).
//
// Plain loops in the reference's order: every GEMM element is a sum over blocks of 32, each
// block's partial a sequential fp32 sum from +0; the weight gradients add, per expert and in
// ascending order, the partials of its 32-row blocks. Threads split rows (the row phases),
// 32-row blocks (quantizing the weight-gradient operands along rows) and accumulator rows
// (the weight gradients); they change who computes an element, never how.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "mok/core/sigmoid_lookup.h"
#include "mok/core/threads.h"
#include "mok/mxfp8/experts.h"

namespace mok::mxfp8 {
namespace {

using core::add_rn;
using core::bf16_to_float;
using core::float_bits;
using core::float_to_bf16;
using core::mac_rn;
using core::parallel_items;
using core::parallel_ranges;
using u8 = std::uint8_t;
using u16 = std::uint16_t;

// The sigmoid from the host table (sigmoid_lookup.h): the reference's bits, without its float64
// exp and division per element.
constexpr core::HostTableSigmoid kSig{};

constexpr std::int64_t kWgradRows = 8;  // accumulator rows per weight-gradient work item

// fp32 values of every E4M3 and E8M0 byte.
struct Tables {
  std::array<float, 256> e4m3{};
  std::array<float, 256> scale{};
  Tables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = decode_e4m3(static_cast<u8>(b));
      scale[b] = scale_value(static_cast<u8>(b));
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

// A weight [El, R, C] as values: normal (blocks along C) and transposed (blocks along R).
struct WeightView {
  const u8* data;
  const u8* scales;
  const u8* data_t;
  const u8* scales_t;
  std::int64_t R, C;

  WeightView(const MxWeight& w, std::int64_t rows, std::int64_t cols)
      : data(reinterpret_cast<const u8*>(w.data)),
        scales(reinterpret_cast<const u8*>(w.scales)),
        data_t(reinterpret_cast<const u8*>(w.data_t)),
        scales_t(reinterpret_cast<const u8*>(w.scales_t)),
        R(rows),
        C(cols) {}

  // w[e, r, c] quantized along C (the normal copy).
  float along_c(std::int64_t e, std::int64_t r, std::int64_t c) const {
    const Tables& t = tables();
    return t.e4m3[data[(e * R + r) * C + c]] *
           t.scale[scales[(e * (C / kBlock) + c / kBlock) * R + r]];
  }

  // w[e, r, c] quantized along R (the transposed copy holds w^T [El, C, R]).
  float along_r(std::int64_t e, std::int64_t r, std::int64_t c) const {
    const Tables& t = tables();
    return t.e4m3[data_t[(e * C + c) * R + r]] *
           t.scale[scales_t[(e * (R / kBlock) + r / kBlock) * C + c]];
  }
};

// Values of one MXFP8 row of `cols` elements (cols E4M3 bytes, then cols/32 scales).
void row_values(const u8* row, std::int64_t cols, float* out) {
  const Tables& t = tables();
  for (std::int64_t c = 0; c < cols; ++c) out[c] = t.e4m3[row[c]] * t.scale[row[cols + c / kBlock]];
}

// in[0, n) quantized in blocks of 32 (RCEIL) and dequantized, in place.
void fake_quantize(float* values, std::int64_t n) {
  const Tables& t = tables();
  for (std::int64_t j = 0; j < n; j += kBlock) {
    u8 q[kBlock];
    const u8 s = quantize_block(
        kBlock, ScaleRule::kRceil, [&](int i) { return float_bits(values[j + i]); },
        [&](int i, u8 v) { q[i] = v; });
    for (int i = 0; i < kBlock; ++i) values[j + i] = t.e4m3[q[i]] * t.scale[s];
  }
}

// sum over blocks of 32 of (sum_k in[k] * w(k)): the blocked reduction of one output element.
template <typename Weight>
float blocked_dot(const float* in, std::int64_t K, const Weight& w) {
  float acc = 0.0f;
  for (std::int64_t k0 = 0; k0 < K; k0 += kBlock) {
    float part = 0.0f;
    for (std::int64_t k = k0; k < k0 + kBlock; ++k) part = mac_rn(part, in[k], w(k));
    acc = add_rn(acc, part);
  }
  return acc;
}

// The expert of each 32-row block (-1: padding only), from the rows' experts.
std::vector<std::int64_t> block_experts(const std::int64_t* experts, std::int64_t M) {
  std::vector<std::int64_t> out(static_cast<std::size_t>((M + kBlock - 1) / kBlock), -1);
  for (std::int64_t m = 0; m < M; ++m) {
    if (experts[m] >= 0) out[static_cast<std::size_t>(m / kBlock)] = experts[m];
  }
  return out;
}

// Columns of u [M, N] quantized along rows in 32-row blocks (rows past M are zero): the
// weight-gradient operand, [blocks * 32, N] values.
std::vector<float> quantize_along_rows(const std::vector<float>& u, std::int64_t M, std::int64_t N,
                                       std::int64_t num_threads) {
  const std::int64_t blocks = (M + kBlock - 1) / kBlock;
  std::vector<float> out(static_cast<std::size_t>(blocks * kBlock * N), 0.0f);
  parallel_ranges(blocks * N, num_threads, [&](std::int64_t begin, std::int64_t end) {
    float column[kBlock];
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t blk = item / N, n = item % N;
      for (std::int64_t i = 0; i < kBlock; ++i) {
        const std::int64_t m = blk * kBlock + i;
        column[i] = m < M ? u[static_cast<std::size_t>(m * N + n)] : 0.0f;
      }
      fake_quantize(column, kBlock);
      for (std::int64_t i = 0; i < kBlock; ++i)
        out[static_cast<std::size_t>((blk * kBlock + i) * N + n)] = column[i];
    }
  });
  return out;
}

}  // namespace

// ------------------------------------------------------------------ forward

namespace {

// What grouped_forward adds to swiglu_forward's outputs: h and its MXFP8 copy (each may be null).
struct HOutputs {
  u16* h = nullptr;  // bf16 [M, I]
  u8* hq = nullptr;  // MXFP8 rows [M, hq_row_bytes(I)]
};

// The forward of rows [0, M) of args (x's rows row_bytes apart).
void forward_rows(const MxForwardArgs& args, std::int64_t row_bytes, const HOutputs& extra) {
  const std::int64_t M = args.shape.num_rows, H = args.shape.hidden, I = args.shape.inner;
  const auto* x = reinterpret_cast<const u8*>(args.x);
  const auto* experts = reinterpret_cast<const std::int64_t*>(args.experts);
  auto* out_a = reinterpret_cast<u16*>(args.out_a);
  auto* out_b = reinterpret_cast<u16*>(args.out_b);
  auto* out_y = reinterpret_cast<u16*>(args.out_y);
  const WeightView gate(args.gate, I, H), up(args.up, I, H), down(args.down, H, I);

  parallel_ranges(M, args.num_threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> xv(static_cast<std::size_t>(H)), h(static_cast<std::size_t>(I));
    for (std::int64_t m = begin; m < end; ++m) {
      const std::int64_t e = experts[m];
      if (e < 0) {  // padding
        std::fill(out_a + m * I, out_a + (m + 1) * I, u16{0});
        std::fill(out_b + m * I, out_b + (m + 1) * I, u16{0});
        if (out_y != nullptr) std::fill(out_y + m * H, out_y + (m + 1) * H, u16{0});
        continue;
      }
      row_values(x + m * row_bytes, H, xv.data());
      for (std::int64_t i = 0; i < I; ++i) {
        const u16 a = float_to_bf16(
            blocked_dot(xv.data(), H, [&](std::int64_t k) { return gate.along_c(e, i, k); }));
        const u16 b = float_to_bf16(
            blocked_dot(xv.data(), H, [&](std::int64_t k) { return up.along_c(e, i, k); }));
        out_a[m * I + i] = a;
        out_b[m * I + i] = b;
        const u16 hb = core::swiglu_h(a, b, args.limit, kSig);
        if (extra.h != nullptr) extra.h[m * I + i] = hb;
        h[i] = bf16_to_float(hb);
      }
      if (out_y == nullptr) continue;
      if (extra.hq != nullptr) {
        u8* row = extra.hq + m * hq_row_bytes(I);
        for (std::int64_t j = 0; j < I / kBlock; ++j) {
          const float* block = h.data() + j * kBlock;
          row[I + j] = quantize_block(
              kBlock, ScaleRule::kRceil, [&](int i) { return float_bits(block[i]); },
              [&](int i, u8 v) { row[j * kBlock + i] = v; });
        }
      }
      fake_quantize(h.data(), I);  // h is quantized along I before the down GEMM
      for (std::int64_t j = 0; j < H; ++j) {
        out_y[m * H + j] = float_to_bf16(
            blocked_dot(h.data(), I, [&](std::int64_t i) { return down.along_c(e, j, i); }));
      }
    }
  });
}

}  // namespace

void swiglu_forward_cpu(const MxForwardArgs& args) {
  forward_rows(args, args.shape.hidden + args.shape.hidden / kBlock, HOutputs{});
}

void grouped_forward_cpu(const MxGroupedForwardArgs& g) {
  const std::int64_t M = g.shape.num_rows, H = g.shape.hidden, I = g.shape.inner;
  const std::int64_t El = g.shape.num_experts;
  const auto* offsets = reinterpret_cast<const std::int64_t*>(g.offsets);
  const std::int64_t lo = std::clamp<std::int64_t>(offsets[0], 0, M);
  const std::int64_t hi = std::clamp<std::int64_t>(offsets[El], lo, M);
  if (hi == lo) return;
  std::vector<std::int64_t> experts(static_cast<std::size_t>(hi - lo));
  for (std::int64_t e = 0; e < El; ++e) {
    const std::int64_t b = std::clamp<std::int64_t>(offsets[e], lo, hi);
    const std::int64_t end = std::clamp<std::int64_t>(offsets[e + 1], b, hi);
    std::fill(experts.begin() + (b - lo), experts.begin() + (end - lo), e);
  }
  const std::int64_t row_bytes = g.x_row_bytes != 0 ? g.x_row_bytes : H + H / kBlock;
  MxForwardArgs args;
  args.x = g.x + static_cast<std::uintptr_t>(lo * row_bytes);
  args.experts = reinterpret_cast<std::uintptr_t>(experts.data());
  args.gate = g.gate;
  args.up = g.up;
  args.down = g.down;
  args.out_a = g.out_a + static_cast<std::uintptr_t>(lo * I * 2);
  args.out_b = g.out_b + static_cast<std::uintptr_t>(lo * I * 2);
  args.out_y = g.out_y == 0 ? 0 : g.out_y + static_cast<std::uintptr_t>(lo * H * 2);
  args.shape = {hi - lo, H, I, El};
  args.limit = g.limit;
  args.num_threads = g.num_threads;
  HOutputs extra;
  if (g.out_y != 0) {
    extra.h = reinterpret_cast<u16*>(g.out_h) + lo * I;
    extra.hq = reinterpret_cast<u8*>(g.out_hq) + lo * hq_row_bytes(I);
  } else if (g.out_h != 0) {
    extra.h = reinterpret_cast<u16*>(g.out_h) + lo * I;
  }
  forward_rows(args, row_bytes, extra);
}

void grouped_gemm_cpu(const MxGroupedGemmArgs& g) {
  const std::int64_t M = g.num_rows, N = g.n, K = g.k, El = g.num_experts;
  const std::int64_t K0 = g.k_split != 0 ? g.k_split : K;
  // A's columns: with a split the second weight's part from split_a_offset(K0) on.
  const std::int64_t KA = split_a_cols(K, g.k_split), gap = KA - K;
  const std::int64_t row_bytes = g.a_row_bytes != 0 ? g.a_row_bytes : KA + KA / kBlock;
  const auto* offsets = reinterpret_cast<const std::int64_t*>(g.offsets);
  const auto* a = reinterpret_cast<const u8*>(g.a);
  // B_e[n, k] quantized along K: the first weight for k < K0, the second after.
  const auto* d0 = reinterpret_cast<const u8*>(g.b0_data);
  const auto* s0 = reinterpret_cast<const u8*>(g.b0_scales);
  const auto* d1 = reinterpret_cast<const u8*>(g.b1_data);
  const auto* s1 = reinterpret_cast<const u8*>(g.b1_scales);
  const Tables& t = tables();
  const auto b_value = [&](std::int64_t e, std::int64_t n, std::int64_t k) {
    if (k < K0) {
      return t.e4m3[d0[(e * N + n) * K0 + k]] *
             t.scale[s0[(e * (K0 / kBlock) + k / kBlock) * N + n]];
    }
    const std::int64_t K1 = K - K0, j = k - K0;
    return t.e4m3[d1[(e * N + n) * K1 + j]] * t.scale[s1[(e * (K1 / kBlock) + j / kBlock) * N + n]];
  };
  for (std::int64_t e = 0; e < El; ++e) {
    const std::int64_t lo = offsets[e], hi = offsets[e + 1];
    parallel_ranges(hi - lo, g.num_threads, [&](std::int64_t begin, std::int64_t end) {
      std::vector<float> av(static_cast<std::size_t>(KA));
      for (std::int64_t r = lo + begin; r < lo + end; ++r) {
        row_values(a + r * row_bytes, KA, av.data());
        // The K values in order: the gap's columns are not A's.
        std::copy(av.begin() + K0 + gap, av.end(), av.begin() + K0);
        for (std::int64_t n = 0; n < N; ++n) {
          const float v =
              blocked_dot(av.data(), K, [&](std::int64_t k) { return b_value(e, n, k); });
          if (g.out_fp32) {
            reinterpret_cast<float*>(g.out)[r * N + n] = v;
          } else {
            reinterpret_cast<u16*>(g.out)[r * N + n] = float_to_bf16(v);
          }
        }
      }
    });
  }
}

void grouped_wgrad_cpu(const MxGroupedWgradArgs& g) {
  const std::int64_t R = g.r, C = g.c, El = g.num_experts;
  const std::int64_t a_row = g.a_row_bytes != 0 ? g.a_row_bytes : g.num_rows;
  const std::int64_t b_row = g.b_row_bytes != 0 ? g.b_row_bytes : g.num_rows;
  const auto* offsets = reinterpret_cast<const std::int64_t*>(g.offsets);
  const auto* ad = reinterpret_cast<const u8*>(g.a_data);
  const auto* as = reinterpret_cast<const u8*>(g.a_scales);
  const auto* bd = reinterpret_cast<const u8*>(g.b_data);
  const auto* bs = reinterpret_cast<const u8*>(g.b_scales);
  const auto* carry = reinterpret_cast<const float*>(g.carry);
  const Tables& t = tables();
  // Work items: (expert, output row); each element's blocks in row order.
  parallel_items(El * R, g.num_threads, [&](std::int64_t item) {
    const std::int64_t e = item / R, r = item % R, lo = offsets[e], hi = offsets[e + 1];
    std::vector<float> av(static_cast<std::size_t>(hi - lo));
    for (std::int64_t m = lo; m < hi; ++m) {
      av[static_cast<std::size_t>(m - lo)] =
          t.e4m3[ad[r * a_row + m]] * t.scale[as[(m / kBlock) * R + r]];
    }
    for (std::int64_t c = 0; c < C; ++c) {
      const std::int64_t at = (e * R + r) * C + c;
      float acc = carry != nullptr ? carry[at] : 0.0f;
      for (std::int64_t m0 = lo; m0 < hi; m0 += kBlock) {
        float part = 0.0f;
        for (std::int64_t m = m0; m < m0 + kBlock; ++m) {
          const float b = t.e4m3[bd[c * b_row + m]] * t.scale[bs[(m / kBlock) * C + c]];
          part = mac_rn(part, av[static_cast<std::size_t>(m - lo)], b);
        }
        acc = add_rn(acc, part);
      }
      if (g.out_f32 != 0) reinterpret_cast<float*>(g.out_f32)[at] = acc;
      if (g.out_bf16 != 0) reinterpret_cast<u16*>(g.out_bf16)[at] = float_to_bf16(acc);
    }
  });
}

// ------------------------------------------------------------------ backward

void swiglu_backward_cpu(const MxBackwardArgs& args) {
  const std::int64_t M = args.shape.num_rows, H = args.shape.hidden, I = args.shape.inner;
  const std::int64_t El = args.shape.num_experts;
  const auto* x = reinterpret_cast<const u8*>(args.x);
  const auto* a = reinterpret_cast<const u16*>(args.a);
  const auto* b = reinterpret_cast<const u16*>(args.b);
  const auto* dy = reinterpret_cast<const u8*>(args.dy);
  const auto* router_weights = reinterpret_cast<const float*>(args.router_weights);
  const auto* experts = reinterpret_cast<const std::int64_t*>(args.experts);
  auto* out_dx = reinterpret_cast<u16*>(args.out_dx);
  auto* out_d_w = reinterpret_cast<float*>(args.out_d_w);
  auto* acc_gate_up = reinterpret_cast<float*>(args.acc_gate_up);
  auto* acc_down = reinterpret_cast<float*>(args.acc_down);
  const WeightView gate(args.gate, I, H), up(args.up, I, H), down(args.down, H, I);
  const std::int64_t row_bytes = H + H / kBlock;

  // The weight gradients' operands, per row (values; zero rows for padding).
  std::vector<float> xs(static_cast<std::size_t>(M * H), 0.0f),
      w_dy(static_cast<std::size_t>(M * H), 0.0f);
  std::vector<float> h(static_cast<std::size_t>(M * I), 0.0f),
      d_ab(static_cast<std::size_t>(M * 2 * I), 0.0f);

  // Phase 1, rows independent: g, d_w, d_a, d_b, dx.
  parallel_ranges(M, args.num_threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> dyv(static_cast<std::size_t>(H)), g(static_cast<std::size_t>(I));
    std::vector<float> dab_q(static_cast<std::size_t>(2 * I));
    for (std::int64_t m = begin; m < end; ++m) {
      const std::int64_t e = experts[m];
      if (e < 0) {  // padding
        std::fill(out_dx + m * H, out_dx + (m + 1) * H, u16{0});
        out_d_w[m] = 0.0f;
        continue;
      }
      const float w = router_weights != nullptr ? router_weights[m] : 1.0f;
      row_values(x + m * row_bytes, H, xs.data() + m * H);
      row_values(dy + m * row_bytes, H, dyv.data());
      // g = dy @ Wd, Wd quantized along H (its transposed copy)
      for (std::int64_t i = 0; i < I; ++i) {
        g[i] = blocked_dot(dyv.data(), H, [&](std::int64_t j) { return down.along_r(e, j, i); });
      }
      float d_w = 0.0f;
      for (std::int64_t i = 0; i < I; ++i) {
        const core::SwigluGrad grad =
            core::swiglu_backward(g[i], w, a[m * I + i], b[m * I + i], args.limit, kSig);
        d_w = mac_rn(d_w, g[i], grad.h);
        h[m * I + i] = grad.h;
        d_ab[m * 2 * I + i] = bf16_to_float(grad.d_a);
        d_ab[m * 2 * I + I + i] = bf16_to_float(grad.d_b);
      }
      out_d_w[m] = d_w;
      // dx = Q([d_a, d_b]) @ [Wg; Wu], the weights quantized along I: one reduction over 2I.
      std::copy(d_ab.begin() + m * 2 * I, d_ab.begin() + (m + 1) * 2 * I, dab_q.begin());
      fake_quantize(dab_q.data(), 2 * I);
      for (std::int64_t j = 0; j < H; ++j) {
        out_dx[m * H + j] = float_to_bf16(blocked_dot(dab_q.data(), 2 * I, [&](std::int64_t c) {
          return c < I ? gate.along_r(e, c, j) : up.along_r(e, c - I, j);
        }));
        w_dy[m * H + j] = bf16_to_float(core::weighted_bf16(w, dyv[j]));
      }
    }
  });

  // Phase 2: the operands quantized along rows, in 32-row blocks.
  const std::vector<float> w_dy_q = quantize_along_rows(w_dy, M, H, args.num_threads);
  const std::vector<float> h_q = quantize_along_rows(h, M, I, args.num_threads);
  const std::vector<float> d_ab_q = quantize_along_rows(d_ab, M, 2 * I, args.num_threads);
  const std::vector<float> x_q = quantize_along_rows(xs, M, H, args.num_threads);
  const std::vector<std::int64_t> block_expert = block_experts(experts, M);
  const auto num_blocks = static_cast<std::int64_t>(block_expert.size());

  // Phase 3, the weight gradients: work items are kWgradRows accumulator rows of one expert
  // (first the 2I rows of d[Wg; Wu], then the H rows of dWd); each adds the partials of the
  // expert's 32-row blocks in ascending order.
  const std::int64_t gate_up_items = (2 * I + kWgradRows - 1) / kWgradRows;
  const std::int64_t down_items = (H + kWgradRows - 1) / kWgradRows;
  const std::int64_t per_expert = gate_up_items + down_items;
  parallel_items(El * per_expert, args.num_threads, [&](std::int64_t item) {
    const std::int64_t e = item / per_expert, k = item % per_expert;
    const bool gate_up = k < gate_up_items;
    const std::int64_t J = gate_up ? 2 * I : H, N = gate_up ? H : I;
    const std::int64_t j0 = (gate_up ? k : k - gate_up_items) * kWgradRows;
    const std::int64_t j1 = std::min(j0 + kWgradRows, J);
    const std::vector<float>& u = gate_up ? d_ab_q : w_dy_q;
    const std::vector<float>& v = gate_up ? x_q : h_q;
    float* acc = gate_up ? acc_gate_up + e * 2 * I * H : acc_down + e * H * I;
    std::vector<float> part(static_cast<std::size_t>((j1 - j0) * N));
    for (std::int64_t blk = 0; blk < num_blocks; ++blk) {
      if (block_expert[static_cast<std::size_t>(blk)] != e) continue;
      std::fill(part.begin(), part.end(), 0.0f);
      for (std::int64_t r = blk * kBlock; r < std::min((blk + 1) * kBlock, M); ++r) {
        if (experts[r] < 0) continue;  // a zero row adds nothing
        const float* v_r = v.data() + r * N;
        for (std::int64_t j = j0; j < j1; ++j) {
          const float u_rj = u[static_cast<std::size_t>(r * J + j)];
          float* p = part.data() + (j - j0) * N;
          for (std::int64_t n = 0; n < N; ++n) p[n] = mac_rn(p[n], u_rj, v_r[n]);
        }
      }
      for (std::int64_t j = j0; j < j1; ++j) {
        float* acc_j = acc + j * N;
        const float* p = part.data() + (j - j0) * N;
        for (std::int64_t n = 0; n < N; ++n) acc_j[n] = add_rn(acc_j[n], p[n]);
      }
    }
  });
}

// The backward's element pass (grouped_swiglu_backward): a 32-row block per work item, the GPU
// kernel's arithmetic in loops.
namespace {

// Column c < cols of a block of 32 rows of bf16 values (row-major, `stride` apart) quantized
// along the rows: 32 bytes at data[c * M + row0], the scale at scales[(row0 / 32) * cols + c].
void quantize_block_columns(const u16* block, std::int64_t stride, std::int64_t cols,
                            std::int64_t M, std::int64_t row0, u8* data, u8* scales) {
  for (std::int64_t c = 0; c < cols; ++c) {
    u8* out = data + c * M + row0;
    scales[(row0 / kBlock) * cols + c] = quantize_block(
        kBlock, ScaleRule::kRceil,
        [&](int i) { return static_cast<std::uint32_t>(block[i * stride + c]) << 16; },
        [&](int i, u8 byte) { out[i] = byte; });
  }
}

// bf16 values [n] quantized along the row: n E4M3 bytes at `data`, n/32 scales at `scales`.
void quantize_row(const u16* values, std::int64_t n, u8* data, u8* scales) {
  for (std::int64_t j = 0; j < n / kBlock; ++j) {
    scales[j] = quantize_block(
        kBlock, ScaleRule::kRceil,
        [&](int i) { return static_cast<std::uint32_t>(values[j * kBlock + i]) << 16; },
        [&](int i, u8 byte) { data[j * kBlock + i] = byte; });
  }
}

}  // namespace

void grouped_swiglu_backward_cpu(const MxSwigluBackwardArgs& g) {
  const std::int64_t M = g.num_rows, H = g.hidden, I = g.inner;
  const std::int64_t x_bytes = g.x_row_bytes != 0 ? g.x_row_bytes : H + H / kBlock;
  const std::int64_t dy_bytes = g.dy_row_bytes != 0 ? g.dy_row_bytes : H + H / kBlock;
  const std::int64_t I1 = split_a_offset(I), dab_cols = split_a_cols(2 * I, I);
  const std::int64_t dab_bytes =
      g.dab_row_bytes != 0 ? g.dab_row_bytes : dab_cols + dab_cols / kBlock;
  const auto* gv = reinterpret_cast<const float*>(g.g);
  const auto* a = reinterpret_cast<const u16*>(g.a);
  const auto* b = reinterpret_cast<const u16*>(g.b);
  const auto* router_weights = reinterpret_cast<const float*>(g.router_weights);
  const auto* x = reinterpret_cast<const u8*>(g.x);
  const auto* dy = reinterpret_cast<const u8*>(g.dy);
  auto* d_w = reinterpret_cast<float*>(g.out_d_w);
  auto* dab = reinterpret_cast<u8*>(g.out_dab);
  const auto out = [](std::uintptr_t p) { return reinterpret_cast<u8*>(p); };
  const Tables& t = tables();
  parallel_items(M / kBlock, g.num_threads, [&](std::int64_t blk) {
    const std::int64_t row0 = blk * kBlock;
    std::vector<u16> h(static_cast<std::size_t>(kBlock * I)),
        d_ab(static_cast<std::size_t>(kBlock * 2 * I)), xs(static_cast<std::size_t>(kBlock * H)),
        w_dy(static_cast<std::size_t>(kBlock * H));
    for (std::int64_t r = 0; r < kBlock; ++r) {
      const std::int64_t m = row0 + r;
      const float w = router_weights != nullptr ? router_weights[m] : 1.0f;
      float d_w_m = 0.0f;
      u16* h_r = h.data() + r * I;
      u16* dab_r = d_ab.data() + r * 2 * I;
      for (std::int64_t i = 0; i < I; ++i) {
        const core::SwigluGrad e =
            core::swiglu_backward(gv[m * I + i], w, a[m * I + i], b[m * I + i], g.limit, kSig);
        d_w_m = mac_rn(d_w_m, gv[m * I + i], e.h);
        h_r[i] = float_to_bf16(e.h);
        dab_r[i] = e.d_a;
        dab_r[I + i] = e.d_b;
      }
      d_w[m] = d_w_m;
      // dx's A in grouped_gemm's split layout: d_b from column I1 on, the scales after K_A.
      u8* dab_m = dab + m * dab_bytes;
      quantize_row(dab_r, I, dab_m, dab_m + dab_cols);
      quantize_row(dab_r + I, I, dab_m + I1, dab_m + dab_cols + I1 / kBlock);
      const u8* x_r = x + m * x_bytes;
      const u8* dy_r = dy + m * dy_bytes;
      for (std::int64_t c = 0; c < H; ++c) {
        xs[r * H + c] = float_to_bf16(t.e4m3[x_r[c]] * t.scale[x_r[H + c / kBlock]]);
        w_dy[r * H + c] = core::weighted_bf16(w, t.e4m3[dy_r[c]] * t.scale[dy_r[H + c / kBlock]]);
      }
    }
    quantize_block_columns(h.data(), I, I, M, row0, out(g.h_t_data), out(g.h_t_scales));
    // d_a's copy, then d_b's: rows I * M bytes on, scales (M/32) * I on.
    quantize_block_columns(d_ab.data(), 2 * I, I, M, row0, out(g.dab_t_data), out(g.dab_t_scales));
    quantize_block_columns(d_ab.data() + I, 2 * I, I, M, row0, out(g.dab_t_data) + I * M,
                           out(g.dab_t_scales) + M / kBlock * I);
    quantize_block_columns(xs.data(), H, H, M, row0, out(g.x_t_data), out(g.x_t_scales));
    quantize_block_columns(w_dy.data(), H, H, M, row0, out(g.wdy_t_data), out(g.wdy_t_scales));
  });
}

}  // namespace mok::mxfp8
