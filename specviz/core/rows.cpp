// specviz_rows::linear(x, w): x [M, K] @ w[N, K]^T for the few rows decoding runs (AR, chains, small trees), fp32.
//
// Why: a decode product streams the whole weight for a handful of rows. The default kernels (MKL) and oneDNN's
// packed ones reach the memory floor at one row, but from four rows they cost a third to a half more, so a tree
// verify pays for rows it barely computes on. Here each weight row is read from memory once for all M rows (a
// group of them at a time, the later groups from L1), with the next rows prefetched, so the product stays near
// the floor longer.
//
// Rules: each output is one vector accumulator over k in order, its lanes summed by halves (hsum); the same
// instructions for every M, so a row's result does not depend on the rows beside it (a verify's logits are a
// one-token forward's, bit for bit). Requires contiguous fp32 x and w with K a multiple of the vector width;
// the caller (core/rows.py) checks and falls back to the default kernels otherwise.
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "rows.h"
#include "simd.h"

namespace {
using namespace simd;  // Reg, V, loadf, fma, zero, hsum (simd.h)
constexpr int PREFETCH_BLOCKS = 1;  // prefetch the weight rows this many blocks ahead (into L1)
constexpr int64_t TILE = 32;        // weight rows per parallel task

// MB rows of x against NB weight rows: out[j, i] = sum_k x[j, k] w[i, k]
template <int MB, int NB, bool PF>
inline void block(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  Reg acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; k += V) {
    Reg xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = loadf(x + j * K + k);
    for (int i = 0; i < NB; ++i) {
      if (PF) __builtin_prefetch(w + (i + NB * PREFETCH_BLOCKS) * K + k, 0, 3);
      Reg wv = loadf(w + i * K + k);
      for (int j = 0; j < MB; ++j) acc[i][j] = fma(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) out[j * N + i] = hsum(acc[i][j]);
}

// block<g, NB, PF> for a group of 1 <= g <= G x rows
template <int NB, bool PF, int G>
void group(int64_t g, const float* x, int64_t K, const float* w, float* out, int64_t N) {
  if constexpr (G > 1)
    if (g < G) return group<NB, PF, G - 1>(g, x, K, w, out, N);
  block<G, NB, PF>(x, K, w, out, N);
}

// M rows of x against weight rows [n0, n1), NB weight rows a block, whose accumulators (NB x G) stay in
// registers. Each block streams in from memory with the first group of x rows (up to G) and is read from L1 by
// the later ones. AVX-512's 32 registers take 4 weight rows and groups of 6 (with 2 weight rows, as before, a
// block of 5-8 x rows did half the arithmetic a cycle); AVX2's 16 take groups of 8 with 4, 2 or 1 weight rows.
// NB and the groups only gather whole outputs, so no output's arithmetic depends on them.
template <int NB, int G>
void panel(int64_t M, const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* out, int64_t N) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    group<NB, true, G>(std::min<int64_t>(G, M), x, K, w + n * K, out + n, N);
    for (int64_t m = G; m < M; m += G)
      group<NB, false, G>(std::min<int64_t>(G, M - m), x + m * K, K, w + n * K, out + m * N + n, N);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; m += G)
      group<1, false, G>(std::min<int64_t>(G, M - m), x + m * K, K, w + n * K, out + m * N + n, N);
}

void rows(int64_t M, const float* x, int64_t K, const float* w, int64_t n0, int64_t n1, float* out, int64_t N) {
#if defined(__AVX512F__)
  panel<4, 6>(M, x, K, w, n0, n1, out, N);
#else
  if (M <= 2) return panel<4, 8>(M, x, K, w, n0, n1, out, N);
  if (M <= 4) return panel<2, 8>(M, x, K, w, n0, n1, out, N);
  panel<1, 8>(M, x, K, w, n0, n1, out, N);
#endif
}

}  // namespace

// x [M, K] against the weights ws (each [N_i, K]) stacked along their rows, without stacking them: a decoder
// layer's q, k and v (or gate and up) in one call. Each output is computed as ``linear`` computes it alone.
at::Tensor specviz_rows_product(const at::Tensor& x, at::TensorList ws) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % V == 0,
              "specviz_rows: x must be a contiguous fp32 [M, K] with K a multiple of ", V);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> first_tile{0}, first_col{0};  // per weight: its first tile and its first output column
  for (const at::Tensor& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kFloat && w.is_contiguous(),
                "specviz_rows: every weight must be a contiguous fp32 [N, ", K, "]");
    first_tile.push_back(first_tile.back() + (w.size(0) + TILE - 1) / TILE);
    first_col.push_back(first_col.back() + w.size(0));
  }
  const int64_t N = first_col.back();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, first_tile.back(), 1, [&](int64_t t0, int64_t t1) {
    size_t l = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first_tile[l + 1]) ++l;
      const float* wp = ws[l].const_data_ptr<float>();
      const int64_t n0 = (t - first_tile[l]) * TILE, n1 = std::min(ws[l].size(0), n0 + TILE);
      float* ol = op + first_col[l];  // this weight's columns; rows stay N apart
      rows(M, xp, K, wp, n0, n1, ol, N);
    }
  });
  return out;
}

namespace {
at::Tensor linear(const at::Tensor& x, const at::Tensor& w) { return specviz_rows_product(x, {w}); }

// The refined LM head's rule (core/head.py) in one call: ``coarse`` [R, N] bf16 logits of ``x`` [R, K] fp32
// against ``w`` [N, K] fp32 (bf16 values); every logit within twice the bound of its row's top is recomputed as the
// fp32 product (this kernel's own arithmetic for one output, so the same whatever else the call holds), the rest
// keep their coarse value. Returns fp32 [R, N], or an empty tensor where more than ``most`` candidates a row on
// average would make the whole fp32 product cheaper (the caller's to take). The passes over the logits run on
// 4,096 columns at a time; what ATen's ops did in six passes (copy, max, compare, nonzero, gather, scatter), two.
at::Tensor refine(const at::Tensor& coarse, const at::Tensor& x, const at::Tensor& w, double row_norm, int64_t most) {
  TORCH_CHECK(coarse.dim() == 2 && coarse.scalar_type() == at::kBFloat16 && coarse.is_contiguous() &&
                  x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) == coarse.size(0) &&
                  x.size(1) % V == 0 && w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.size(0) == coarse.size(1) && w.size(1) == x.size(1),
              "specviz_rows::refine: coarse bf16 [R, N], x fp32 [R, K], w fp32 [N, K], contiguous, K a multiple of ",
              V);
  constexpr int64_t SPAN = 4096;
  const int64_t R = coarse.size(0), N = coarse.size(1), K = x.size(1), spans = (N + SPAN - 1) / SPAN;
  at::Tensor out = at::empty({R, N}, x.options());
  const c10::BFloat16* cp = coarse.const_data_ptr<c10::BFloat16>();
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  std::vector<float> tops(R * spans), floors(R);
  std::vector<int64_t> counts(R * spans);
  at::parallel_for(0, R * spans, 1, [&](int64_t t0, int64_t t1) {  // the coarse logits in fp32, and their tops
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / spans, n0 = (t % spans) * SPAN, n1 = std::min(N, n0 + SPAN);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t n = n0; n < n1; ++n) {
        const float c = static_cast<float>(cp[r * N + n]);
        op[r * N + n] = c;
        top = c > top ? c : top;
      }
      tops[t] = top;
    }
  });
  const float gamma = static_cast<float>(K) * 0x1p-23f, rn = static_cast<float>(row_norm);
  for (int64_t r = 0; r < R; ++r) {  // the bound E on |coarse - exact| near the top: core/head.py's rule
    float top = tops[r * spans], rounding = 0.0f, size = 0.0f;
    for (int64_t s = 1; s < spans; ++s) top = std::max(top, tops[r * spans + s]);
    for (int64_t k = 0; k < K; ++k) {
      const float v = xp[r * K + k], e = v - static_cast<float>(static_cast<c10::BFloat16>(v));
      rounding += e * e;
      size += v * v;
    }
    const float bound = 1.1f * (rn * std::sqrt(rounding) + 2 * gamma * rn * std::sqrt(size) + 0x1p-8f * std::fabs(top)) + 1e-30f;
    floors[r] = top - 2 * bound;
  }
  at::parallel_for(0, R * spans, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / spans, n0 = (t % spans) * SPAN, n1 = std::min(N, n0 + SPAN);
      int64_t c = 0;
      for (int64_t n = n0; n < n1; ++n) c += op[r * N + n] >= floors[r];
      counts[t] = c;
    }
  });
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (total > most * R) return at::empty({0}, x.options());
  at::parallel_for(0, R * spans, 1, [&](int64_t t0, int64_t t1) {  // the candidates, exact
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / spans, n0 = (t % spans) * SPAN, n1 = std::min(N, n0 + SPAN);
      if (!counts[t]) continue;
      for (int64_t n = n0; n < n1; ++n)
        if (op[r * N + n] >= floors[r]) block<1, 1, false>(xp + r * K, K, wp + n * K, op + r * N + n, N);
    }
  });
  return out;
}

}  // namespace

int64_t specviz_rows_width() { return V; }

TORCH_LIBRARY(specviz_rows, m) {
  m.def("linear(Tensor x, Tensor w) -> Tensor");
  m.def("width() -> int");
  m.def("refine(Tensor coarse, Tensor x, Tensor w, float row_norm, int most) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.impl("refine", c10::DispatchKey::CPU, TORCH_FN(refine));
  m.impl("width", c10::DispatchKey::CatchAll, TORCH_FN(specviz_rows_width));
}
