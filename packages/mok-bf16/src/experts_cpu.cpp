// The CPU implementation of the BF16 experts (mok/bf16/experts.h).
//
// Every output element is one sequential reduction in the reference's order; the code only
// vectorises and threads across elements that are independent of each other:
// - the forward GEMMs reduce along contiguous weight rows, so they run on tiles of up to
//   kTileRows rows of one expert, the rows being the vector lanes;
// - the backward's per-row GEMMs (g = dy @ Wd, dx = d_ab @ [Wg; Wu]) have the output dimension
//   contiguous in the weights, so one row's outputs are the lanes;
// - the weight gradients reduce over rows: each expert's rows are added in ascending order,
//   and threads split the experts' output rows, never one expert's rows.
// Threads split rows in the row-independent phases; how the rows are split changes who
// computes a row, never how, so the bits do not depend on num_threads.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "mok/bf16/experts.h"
#include "mok/core/sigmoid_lookup.h"
#include "mok/core/threads.h"

namespace mok::bf16 {
namespace {

using u16 = std::uint16_t;

constexpr std::int64_t kTileRows = 8;   // rows of one expert per forward GEMM tile (lanes)
constexpr std::int64_t kTileCols = 4;   // output columns per pass over a tile
constexpr std::int64_t kWgradRows = 8;  // accumulator rows per weight-gradient work item

using mok::core::parallel_items;
using mok::core::parallel_ranges;

// The sigmoid from the host table (sigmoid_lookup.h): the reference's bits, without its float64
// exp and division per element.
constexpr mok::core::HostTableSigmoid kSig{};

// ------------------------------------------------------------------ GEMM pieces

// out[c][r] = sum_k in_t[k][r] * w[c][k] (k ascending, from +0) for kCols weight rows c.
// in_t: [K][kTileRows] fp32 holding bf16 values; w: bf16 rows of length K.
template <std::int64_t kCols>
void tile_columns(const float* in_t, const u16* w, std::int64_t K, float* out) {
  float acc[kCols][kTileRows] = {};
  for (std::int64_t k = 0; k < K; ++k) {
    const float* in_k = in_t + k * kTileRows;
    for (std::int64_t c = 0; c < kCols; ++c) {
      const float w_ck = bf16_to_float(w[c * K + k]);
      for (std::int64_t r = 0; r < kTileRows; ++r) acc[c][r] = mac_rn(acc[c][r], in_k[r], w_ck);
    }
  }
  for (std::int64_t c = 0; c < kCols; ++c) {
    for (std::int64_t r = 0; r < kTileRows; ++r) out[c * kTileRows + r] = acc[c][r];
  }
}

// out[n][r] = sum_k in_t[k][r] * w[n][k] for every n < N: a tile of rows times w^T, w: bf16
// [N, K] (an nn.Linear weight). out: [N][kTileRows].
void tile_times_weight_t(const float* in_t, const u16* w, std::int64_t K, std::int64_t N,
                         float* out) {
  std::int64_t n = 0;
  for (; n + kTileCols <= N; n += kTileCols) {
    tile_columns<kTileCols>(in_t, w + n * K, K, out + n * kTileRows);
  }
  for (; n < N; ++n) tile_columns<1>(in_t, w + n * K, K, out + n * kTileRows);
}

// acc[n] += sum_k in[k] * w[k][n] (k ascending): one row times w, w: bf16 [K, N].
void row_times_weight(const float* in, const u16* w, std::int64_t K, std::int64_t N, float* acc) {
  for (std::int64_t k = 0; k < K; ++k) {
    const float in_k = in[k];
    const u16* w_k = w + k * N;
    for (std::int64_t n = 0; n < N; ++n) acc[n] = mac_rn(acc[n], in_k, bf16_to_float(w_k[n]));
  }
}

// ------------------------------------------------------------------ rows

// Rows [begin, end) as runs of at most kTileRows consecutive rows of one expert; padding rows
// (expert -1) one by one, with e = -1.
template <typename Tile>
void for_each_tile(const std::int64_t* experts, std::int64_t begin, std::int64_t end,
                   const Tile& tile) {
  for (std::int64_t m = begin; m < end;) {
    const std::int64_t e = experts[m];
    std::int64_t n = 1;
    if (e >= 0) {
      while (n < kTileRows && m + n < end && experts[m + n] == e) ++n;
    }
    tile(m, n, e);
    m += n;
  }
}

// The rows of each expert in ascending order: rows[offsets[e], offsets[e + 1]).
struct RowsByExpert {
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> rows;

  RowsByExpert(const std::int64_t* experts, std::int64_t num_rows, std::int64_t num_experts)
      : offsets(static_cast<std::size_t>(num_experts + 1), 0) {
    for (std::int64_t m = 0; m < num_rows; ++m) {
      if (experts[m] >= 0) ++offsets[static_cast<std::size_t>(experts[m] + 1)];
    }
    for (std::int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
    rows.resize(static_cast<std::size_t>(offsets.back()));
    std::vector<std::int64_t> next(offsets.begin(), offsets.end() - 1);
    for (std::int64_t m = 0; m < num_rows; ++m) {
      if (experts[m] >= 0) rows[static_cast<std::size_t>(next[experts[m]]++)] = m;
    }
  }
};

// A schedule table as the whole-layer calls read it on the host: its int32 offsets widened to the
// grouped entry points' int64, the rows in use [first, last), and each row's route and source.
struct HostTable {
  std::vector<std::int64_t> offsets;
  std::int64_t first, last;
  const std::int32_t* row_route;
  const std::int32_t* row_src;
  std::int64_t world_size, routes;

  HostTable(std::uintptr_t offsets32, std::int64_t num_experts, std::uintptr_t route,
            std::uintptr_t src, std::int64_t ranks, std::int64_t num_routes)
      : offsets(static_cast<std::size_t>(num_experts + 1)),
        row_route(reinterpret_cast<const std::int32_t*>(route)),
        row_src(reinterpret_cast<const std::int32_t*>(src)),
        world_size(ranks),
        routes(num_routes) {
    const auto* off = reinterpret_cast<const std::int32_t*>(offsets32);
    for (std::int64_t e = 0; e <= num_experts; ++e) offsets[static_cast<std::size_t>(e)] = off[e];
    first = off[0];
    last = off[num_experts];
  }
  // Row r's route and, in `rank`, its source rank (0 at one rank), or -1: a padding row (a route
  // outside [0, routes) or a source outside [0, world_size): nothing read, nothing stored).
  std::int64_t source(std::int64_t r, std::int64_t& rank) const {
    const std::int64_t route = row_route[r];
    rank = world_size > 1 ? row_src[r] : 0;
    if (route < 0 || route >= routes || rank < 0 || rank >= world_size) return -1;
    return route;
  }
  // fn(r, rank, route) for every row in use that has a route (padding rows skipped), rows split
  // among num_threads threads (each row once: the callers' rows and routes never collide).
  template <class Fn>
  void for_each_route(std::int64_t num_threads, const Fn& fn) const {
    parallel_ranges(last - first, num_threads, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = first + lo; r < first + hi; ++r) {
        std::int64_t rank = 0;
        const std::int64_t route = source(r, rank);
        if (route >= 0) fn(r, rank, route);
      }
    });
  }
};

// Each rank's array from an int64 [world_size] table of addresses, or the one rank's own.
template <class T>
T* rank_array(std::uintptr_t ranks, std::uintptr_t own, std::int64_t world_size,
              std::int64_t rank) {
  if (world_size > 1) {
    return reinterpret_cast<T*>(
        static_cast<std::uintptr_t>(reinterpret_cast<const std::int64_t*>(ranks)[rank]));
  }
  return reinterpret_cast<T*>(own);
}

}  // namespace

// ------------------------------------------------------------------ forward

void swiglu_forward_cpu(const SwigluForwardArgs& args) {
  const std::int64_t M = args.shape.num_rows, H = args.shape.hidden, I = args.shape.inner;
  const auto* x = reinterpret_cast<const u16*>(args.x);
  const auto* experts = reinterpret_cast<const std::int64_t*>(args.experts);
  const auto* w_gate = reinterpret_cast<const u16*>(args.w_gate);
  const auto* w_up = reinterpret_cast<const u16*>(args.w_up);
  const auto* w_down = reinterpret_cast<const u16*>(args.w_down);
  auto* out_a = reinterpret_cast<u16*>(args.out_a);
  auto* out_b = reinterpret_cast<u16*>(args.out_b);
  auto* out_y = reinterpret_cast<u16*>(args.out_y);
  const SwigluLimit limit = args.limit;

  parallel_ranges(M, args.num_threads, [&](std::int64_t begin, std::int64_t end) {
    // Tiles hold their rows transposed, lanes past the tile's rows zero (and unused).
    std::vector<float> x_t(static_cast<std::size_t>(H * kTileRows));
    std::vector<float> gate(static_cast<std::size_t>(I * kTileRows));
    std::vector<float> up(static_cast<std::size_t>(I * kTileRows));
    std::vector<float> h_t(static_cast<std::size_t>(out_y != nullptr ? I * kTileRows : 0));
    std::vector<float> y(static_cast<std::size_t>(out_y != nullptr ? H * kTileRows : 0));
    for_each_tile(experts, begin, end, [&](std::int64_t m0, std::int64_t n, std::int64_t e) {
      if (e < 0) {  // padding
        std::fill(out_a + m0 * I, out_a + (m0 + 1) * I, u16{0});
        std::fill(out_b + m0 * I, out_b + (m0 + 1) * I, u16{0});
        if (out_y != nullptr) std::fill(out_y + m0 * H, out_y + (m0 + 1) * H, u16{0});
        return;
      }
      for (std::int64_t k = 0; k < H; ++k) {
        for (std::int64_t r = 0; r < kTileRows; ++r) {
          x_t[k * kTileRows + r] = r < n ? bf16_to_float(x[(m0 + r) * H + k]) : 0.0f;
        }
      }
      tile_times_weight_t(x_t.data(), w_gate + e * I * H, H, I, gate.data());
      tile_times_weight_t(x_t.data(), w_up + e * I * H, H, I, up.data());
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int64_t i = 0; i < I; ++i) {
          out_a[(m0 + r) * I + i] = float_to_bf16(gate[i * kTileRows + r]);
          out_b[(m0 + r) * I + i] = float_to_bf16(up[i * kTileRows + r]);
        }
      }
      if (out_y == nullptr) return;
      for (std::int64_t i = 0; i < I; ++i) {
        for (std::int64_t r = 0; r < kTileRows; ++r) {
          h_t[i * kTileRows + r] =
              r < n ? bf16_to_float(
                          swiglu_h(out_a[(m0 + r) * I + i], out_b[(m0 + r) * I + i], limit, kSig))
                    : 0.0f;
        }
      }
      tile_times_weight_t(h_t.data(), w_down + e * H * I, I, H, y.data());
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int64_t k = 0; k < H; ++k)
          out_y[(m0 + r) * H + k] = float_to_bf16(y[k * kTileRows + r]);
      }
    });
  });
}

// ------------------------------------------------------------------ backward

void swiglu_backward_cpu(const SwigluBackwardArgs& args) {
  const std::int64_t M = args.shape.num_rows, H = args.shape.hidden, I = args.shape.inner;
  const std::int64_t El = args.shape.num_experts;
  const auto* x = reinterpret_cast<const u16*>(args.x);
  const auto* a = reinterpret_cast<const u16*>(args.a);
  const auto* b = reinterpret_cast<const u16*>(args.b);
  const auto* dy = reinterpret_cast<const u16*>(args.dy);
  const auto* router_weights = reinterpret_cast<const float*>(args.router_weights);
  const auto* experts = reinterpret_cast<const std::int64_t*>(args.experts);
  const auto* w_gate = reinterpret_cast<const u16*>(args.w_gate);
  const auto* w_up = reinterpret_cast<const u16*>(args.w_up);
  const auto* w_down = reinterpret_cast<const u16*>(args.w_down);
  auto* out_dx = reinterpret_cast<u16*>(args.out_dx);
  auto* out_d_w = reinterpret_cast<float*>(args.out_d_w);
  auto* acc_gate_up = reinterpret_cast<float*>(args.acc_gate_up);
  auto* acc_down = reinterpret_cast<float*>(args.acc_down);
  const SwigluLimit limit = args.limit;

  // The weight gradients' operands, per row: [d_a, d_b], h and bf16(w dy) (bf16 values).
  std::vector<u16> d_ab(static_cast<std::size_t>(M * 2 * I));
  std::vector<u16> h(static_cast<std::size_t>(M * I));
  std::vector<u16> w_dy(static_cast<std::size_t>(M * H));

  // Phase 1, rows independent: g, d_w, d_a, d_b, dx.
  parallel_ranges(M, args.num_threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> dy_m(static_cast<std::size_t>(H)), g(static_cast<std::size_t>(I));
    std::vector<float> d_ab_m(static_cast<std::size_t>(2 * I)), dx(static_cast<std::size_t>(H));
    for (std::int64_t m = begin; m < end; ++m) {
      const std::int64_t e = experts[m];
      if (e < 0) {  // padding
        std::fill(out_dx + m * H, out_dx + (m + 1) * H, u16{0});
        out_d_w[m] = 0.0f;
        continue;
      }
      const float w = router_weights != nullptr ? router_weights[m] : 1.0f;
      for (std::int64_t k = 0; k < H; ++k) dy_m[k] = bf16_to_float(dy[m * H + k]);
      std::fill(g.begin(), g.end(), 0.0f);
      row_times_weight(dy_m.data(), w_down + e * H * I, H, I, g.data());
      float d_w = 0.0f;
      for (std::int64_t i = 0; i < I; ++i) {
        const SwigluGrad grad = swiglu_backward(g[i], w, a[m * I + i], b[m * I + i], limit, kSig);
        d_w = mac_rn(d_w, g[i], grad.h);
        h[m * I + i] = float_to_bf16(grad.h);
        d_ab[m * 2 * I + i] = grad.d_a;
        d_ab[m * 2 * I + I + i] = grad.d_b;
        d_ab_m[i] = bf16_to_float(grad.d_a);
        d_ab_m[I + i] = bf16_to_float(grad.d_b);
      }
      out_d_w[m] = d_w;
      // dx = d_a @ Wg + d_b @ Wu: one reduction over 2I, the gate part first.
      std::fill(dx.begin(), dx.end(), 0.0f);
      row_times_weight(d_ab_m.data(), w_gate + e * I * H, I, H, dx.data());
      row_times_weight(d_ab_m.data() + I, w_up + e * I * H, I, H, dx.data());
      for (std::int64_t k = 0; k < H; ++k) {
        out_dx[m * H + k] = float_to_bf16(dx[k]);
        w_dy[m * H + k] = weighted_bf16(w, dy_m[k]);
      }
    }
  });

  // Phase 2, the weight gradients: work items are blocks of kWgradRows accumulator rows of one
  // expert (first the 2I rows of d[Wg; Wu], then the H rows of dWd); each adds the expert's rows
  // in ascending order.
  const RowsByExpert by_expert(experts, M, El);
  const std::int64_t gate_up_blocks = (2 * I + kWgradRows - 1) / kWgradRows;
  const std::int64_t down_blocks = (H + kWgradRows - 1) / kWgradRows;
  const std::int64_t blocks = gate_up_blocks + down_blocks;
  parallel_items(El * blocks, args.num_threads, [&](std::int64_t item) {
    const std::int64_t e = item / blocks, block = item % blocks;
    const std::int64_t* rows = by_expert.rows.data() + by_expert.offsets[e];
    const std::int64_t num = by_expert.offsets[e + 1] - by_expert.offsets[e];
    // acc[j][:] += u[r][j] * v[r][:] for the rows r in order, j in this block.
    const bool gate_up = block < gate_up_blocks;
    const std::int64_t J = gate_up ? 2 * I : H, N = gate_up ? H : I;
    const std::int64_t j0 = (gate_up ? block : block - gate_up_blocks) * kWgradRows;
    const std::int64_t j1 = std::min(j0 + kWgradRows, J);
    float* acc = gate_up ? acc_gate_up + e * 2 * I * H : acc_down + e * H * I;
    if (num == 0) return;
    std::vector<float> v(static_cast<std::size_t>(N));
    for (std::int64_t t = 0; t < num; ++t) {
      const std::int64_t m = rows[t];
      const u16* u_m = gate_up ? d_ab.data() + m * 2 * I : w_dy.data() + m * H;
      const u16* v_m = gate_up ? x + m * H : h.data() + m * I;
      for (std::int64_t n = 0; n < N; ++n) v[n] = bf16_to_float(v_m[n]);
      for (std::int64_t j = j0; j < j1; ++j) {
        const float u = bf16_to_float(u_m[j]);
        float* acc_j = acc + j * N;
        for (std::int64_t n = 0; n < N; ++n) acc_j[n] = mac_rn(acc_j[n], u, v[n]);
      }
    }
  });
}

// Each segment through the per-row forward with every row's expert set to the segment's, then
// h from the written a and b; rows outside the segments are left alone.
void grouped_forward_cpu(const GroupedForwardArgs& args) {
  const std::int64_t El = args.shape.num_experts, H = args.shape.hidden, I = args.shape.inner;
  const auto* offsets = reinterpret_cast<const std::int64_t*>(args.offsets);
  for (std::int64_t e = 0; e < El; ++e) {
    const std::int64_t lo = offsets[e], n = offsets[e + 1] - lo;
    if (n == 0) continue;
    const std::vector<std::int64_t> experts(static_cast<std::size_t>(n), e);
    SwigluForwardArgs f;
    f.x = args.x + static_cast<std::uintptr_t>(lo * H * 2);
    f.experts = reinterpret_cast<std::uintptr_t>(experts.data());
    f.w_gate = args.w_gate;
    f.w_up = args.w_up;
    f.w_down = args.w_down;
    f.out_a = args.out_a + static_cast<std::uintptr_t>(lo * I * 2);
    f.out_b = args.out_b + static_cast<std::uintptr_t>(lo * I * 2);
    f.out_y = args.out_y == 0 ? 0 : args.out_y + static_cast<std::uintptr_t>(lo * H * 2);
    f.shape = {n, H, I, El};
    f.limit = args.limit;
    f.num_threads = args.num_threads;
    swiglu_forward_cpu(f);
    if (args.out_h == 0) continue;
    const auto* a = reinterpret_cast<const u16*>(f.out_a);
    const auto* b = reinterpret_cast<const u16*>(f.out_b);
    auto* h = reinterpret_cast<u16*>(args.out_h) + lo * I;
    for (std::int64_t i = 0; i < n * I; ++i)
      h[i] = mok::core::swiglu_h(a[i], b[i], args.limit, kSig);
  }
}

// Each segment through the per-row backward with every row's expert set to the segment's, in
// expert order: each accumulator sees its expert's rows in ascending order, as in one call of
// swiglu_backward over the rows. The weight gradients go through one [El, 2I, H] + [El, H, I]
// fp32 accumulator (the per-row entry point's layout), filled from the caller's accumulators
// (carry_in) or +0, then copied to the accumulators and outputs asked for. Rows outside the
// segments are left alone.
void grouped_backward_cpu(const GroupedBackwardArgs& args) {
  const std::int64_t El = args.shape.num_experts, H = args.shape.hidden, I = args.shape.inner;
  const std::int64_t block = I * H;  // elements of one expert's dWg, dWu or dWd
  const auto* offsets = reinterpret_cast<const std::int64_t*>(args.offsets);
  const auto at = [](std::uintptr_t base, std::int64_t elements, std::int64_t bytes) {
    return base == 0 ? std::uintptr_t{0} : base + static_cast<std::uintptr_t>(elements * bytes);
  };
  std::vector<float> gate_up(static_cast<std::size_t>(El * 2 * block), 0.0f);
  std::vector<float> down(static_cast<std::size_t>(El * block), 0.0f);
  // Expert e's gate, up and down blocks in the combined accumulators.
  const auto part = [&](int which, std::int64_t e) {
    return which == 2 ? down.data() + e * block : gate_up.data() + (2 * e + which) * block;
  };
  const std::uintptr_t accs[3] = {args.acc_gate, args.acc_up, args.acc_down};
  const std::uintptr_t outs[3] = {args.out_gate, args.out_up, args.out_down};
  if (args.carry_in) {
    for (int which = 0; which < 3; ++which) {
      const auto* acc = reinterpret_cast<const float*>(accs[which]);
      for (std::int64_t e = 0; e < El; ++e) std::copy_n(acc + e * block, block, part(which, e));
    }
  }
  for (std::int64_t e = 0; e < El; ++e) {
    const std::int64_t lo = offsets[e], n = offsets[e + 1] - lo;
    if (n == 0) continue;
    const std::vector<std::int64_t> experts(static_cast<std::size_t>(n), e);
    SwigluBackwardArgs b;
    b.x = at(args.x, lo * H, 2);
    b.a = at(args.a, lo * I, 2);
    b.b = at(args.b, lo * I, 2);
    b.dy = at(args.dy, lo * H, 2);
    b.router_weights = at(args.router_weights, lo, 4);
    b.experts = reinterpret_cast<std::uintptr_t>(experts.data());
    b.w_gate = args.w_gate;
    b.w_up = args.w_up;
    b.w_down = args.w_down;
    b.out_dx = at(args.out_dx, lo * H, 2);
    b.out_d_w = at(args.out_d_w, lo, 4);
    b.acc_gate_up = reinterpret_cast<std::uintptr_t>(gate_up.data());
    b.acc_down = reinterpret_cast<std::uintptr_t>(down.data());
    b.shape = {n, H, I, El};
    b.limit = args.limit;
    b.num_threads = args.num_threads;
    swiglu_backward_cpu(b);
  }
  for (int which = 0; which < 3; ++which) {
    auto* acc = reinterpret_cast<float*>(accs[which]);
    auto* out = reinterpret_cast<u16*>(outs[which]);
    for (std::int64_t e = 0; e < El; ++e) {
      const float* sum = part(which, e);
      if (acc != nullptr) std::copy_n(sum, block, acc + e * block);
      if (out != nullptr) {
        for (std::int64_t i = 0; i < block; ++i) out[e * block + i] = float_to_bf16(sum[i]);
      }
    }
  }
}

// ------------------------------------------------------------------ the whole forward

// moe_forward on the CPU: each table row's x gathered from its source's token rows (in table
// order, into out_x or a scratch), the segments through grouped_forward_cpu (so the bits of the
// CPU chain, which moves the same rows into table order first), then each row's y stored at its
// route in its source's output rows. Offsets checked by the caller.
void moe_forward_cpu(const MoeForwardArgs& args) {
  const std::int64_t C = args.shape.num_rows, H = args.shape.hidden, I = args.shape.inner;
  const std::int64_t El = args.shape.num_experts, K = args.topk, R = args.world_size;
  const HostTable table(args.offsets, El, args.row_route, args.row_src, R, args.num_tokens * K);
  const std::int64_t first = table.first, last = table.last;
  const auto scratch = [C](std::vector<u16>& v, std::uintptr_t given, std::int64_t cols) {
    if (given != 0) return reinterpret_cast<u16*>(given);
    v.assign(static_cast<std::size_t>(C * cols), 0);
    return v.data();
  };
  std::vector<u16> x_tmp, a_tmp, b_tmp, y_tmp(static_cast<std::size_t>(C * H));
  u16* xr = scratch(x_tmp, args.out_x, H);
  u16* a = scratch(a_tmp, args.out_a, I);
  u16* b = scratch(b_tmp, args.out_b, I);
  parallel_ranges(C, args.num_threads, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      std::int64_t rank = 0;
      // A padding row (route -1) reads zeros, as the GPU's gather does.
      const std::int64_t route = r < first || r >= last ? -1 : table.source(r, rank);
      u16* to = xr + r * H;
      if (route < 0) {
        std::fill(to, to + H, u16{0});
        continue;
      }
      const auto* from = rank_array<const u16>(args.x_ranks, args.x, R, rank);
      std::copy(from + route / K * H, from + (route / K + 1) * H, to);
    }
  });
  // Rows outside the segments: a and b zero (the GPU's launch writes every row).
  for (std::int64_t r = 0; r < C; ++r) {
    if (r >= first && r < last) continue;
    std::fill(a + r * I, a + (r + 1) * I, u16{0});
    std::fill(b + r * I, b + (r + 1) * I, u16{0});
  }
  GroupedForwardArgs g;
  g.x = reinterpret_cast<std::uintptr_t>(xr);
  g.offsets = reinterpret_cast<std::uintptr_t>(table.offsets.data());
  g.w_gate = args.w_gate;
  g.w_up = args.w_up;
  g.w_down = args.w_down;
  g.out_a = reinterpret_cast<std::uintptr_t>(a);
  g.out_b = reinterpret_cast<std::uintptr_t>(b);
  g.out_h = args.scratch_h;
  g.out_y = reinterpret_cast<std::uintptr_t>(y_tmp.data());
  g.shape = args.shape;
  g.limit = args.limit;
  g.num_threads = args.num_threads;
  if (last > first) grouped_forward_cpu(g);
  // Each route's row where its source reads it (rows of different routes: no two rows collide).
  table.for_each_route(
      args.num_threads, [&](std::int64_t r, std::int64_t rank, std::int64_t route) {
        auto* to = rank_array<u16>(args.out_rows_ranks, args.out_rows, R, rank);
        std::copy(y_tmp.data() + r * H, y_tmp.data() + (r + 1) * H, to + route * H);
      });
}

// ------------------------------------------------------------------ the whole backward

// moe_backward on the CPU: each table row's dy and router weight gathered from its source (in
// table order), the segments through grouped_backward_cpu (so the bits of the CPU chain, which
// moves the same rows into table order first), then each row's dx and d_w stored at its route in
// its source's arrays. Offsets checked by the caller.
void moe_backward_cpu(const MoeBackwardArgs& args) {
  const std::int64_t C = args.shape.num_rows, H = args.shape.hidden;
  const std::int64_t El = args.shape.num_experts, K = args.topk, R = args.world_size;
  const HostTable table(args.offsets, El, args.row_route, args.row_src, R, args.num_tokens * K);
  const bool weighted = R > 1 || args.router_weights != 0;

  // dy and w in table order (zeros and weight 0 for padding rows and rows outside the segments).
  std::vector<u16> dy(static_cast<std::size_t>(C * H), 0), dx(static_cast<std::size_t>(C * H));
  std::vector<float> w(weighted ? static_cast<std::size_t>(C) : 0, 0.0f),
      d_w(static_cast<std::size_t>(C));
  table.for_each_route(
      args.num_threads, [&](std::int64_t r, std::int64_t rank, std::int64_t route) {
        const u16* from = rank_array<const u16>(args.dy_ranks, args.dy, R, rank) + route / K * H;
        std::copy(from, from + H, dy.data() + r * H);
        if (weighted) {
          w[static_cast<std::size_t>(r)] =
              rank_array<const float>(args.weights_ranks, args.router_weights, R, rank)[route];
        }
      });
  GroupedBackwardArgs g;
  g.x = args.x;
  g.offsets = reinterpret_cast<std::uintptr_t>(table.offsets.data());
  g.a = args.a;
  g.b = args.b;
  g.dy = reinterpret_cast<std::uintptr_t>(dy.data());
  g.router_weights = weighted ? reinterpret_cast<std::uintptr_t>(w.data()) : 0;
  g.w_gate = args.w_gate;
  g.w_up = args.w_up;
  g.w_down = args.w_down;
  g.out_dx = reinterpret_cast<std::uintptr_t>(dx.data());
  g.out_d_w = reinterpret_cast<std::uintptr_t>(d_w.data());
  g.acc_gate = args.acc_gate;
  g.acc_up = args.acc_up;
  g.acc_down = args.acc_down;
  g.out_gate = args.out_gate;
  g.out_up = args.out_up;
  g.out_down = args.out_down;
  g.carry_in = args.carry_in;
  g.shape = args.shape;
  g.limit = args.limit;
  g.num_threads = args.num_threads;
  grouped_backward_cpu(g);
  // Each route's dx row and d_w where its source reads them (rows of different routes: no two
  // rows collide).
  const bool d_router = R > 1 ? args.out_d_router_ranks != 0 : args.out_d_router != 0;
  table.for_each_route(
      args.num_threads, [&](std::int64_t r, std::int64_t rank, std::int64_t route) {
        u16* to = rank_array<u16>(args.out_dx_rows_ranks, args.out_dx_rows, R, rank);
        std::copy(dx.data() + r * H, dx.data() + (r + 1) * H, to + route * H);
        if (d_router) {
          rank_array<float>(args.out_d_router_ranks, args.out_d_router, R, rank)[route] =
              d_w[static_cast<std::size_t>(r)];
        }
      });
}

}  // namespace mok::bf16
