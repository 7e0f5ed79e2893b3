// specviz_rows::attend(q, k, v, mask, scale): attention for the few queries a decode step or a verify runs.
//
// Why: PyTorch's CPU flash kernel is built for long queries. For one decode query (a group's heads as three rows
// over a few hundred keys) most of its time is fixed cost, while the work is a few thousand short dot products
// (docs/tuning.md has the timings).
//
// Rules:
// - q [B, H, Q, D], k and v [B, KVH, L, D] (H a multiple of KVH: head h reads key/value head h / (H / KVH)), fp32
//   or bf16 alike, the last dimension contiguous, any other strides (a cache's live rows are a view of its store);
//   mask: none, boolean (true: seen) or additive in q's dtype, [1 or B, 1 or H, Q, L], any strides. The output is
//   [B, Q, H, D] contiguous in q's dtype, the layout transformers' attention functions return.
// - Each output row is a function of its query and of the keys it sees, in order, and of nothing else: a score
//   is one fp32 dot product (vector lanes over d, then the lanes summed by halves), the softmax's sum and the
//   value sum run over the keys in order, and a key a row does not see weighs exactly 0, so adds nothing. So a row of
//   a tree verify, whose keys have gaps where its non-ancestors sit, is bit for bit the row a one-token forward
//   over the same keys computes, and no row depends on the rows beside it.
// - exp is a polynomial (Cephes' expf, about 1 ulp) applied lane by lane, so a score's exp does not depend on the
//   lane it lands in either.
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "simd.h"

namespace {
using namespace simd;

// exp(x) lane by lane (Cephes' expf); x below -87.3 gives 0, so a key scored -inf (or a mask's most negative
// number) weighs exactly nothing
inline Reg vexp(Reg x) {
  constexpr float LOW = -87.3f;
  Reg in = x;
  x = vmin(vmax(x, set1(LOW)), set1(88.3f));
  Reg n = floor(fma(x, set1(1.44269504088896341f), set1(0.5f)));
  x = sub(x, mul(n, set1(0.693359375f)));
  x = sub(x, mul(n, set1(-2.12194440e-4f)));
  Reg y = set1(1.9875691500e-4f);
  y = fma(y, x, set1(1.3981999507e-3f));
  y = fma(y, x, set1(8.3334519073e-3f));
  y = fma(y, x, set1(4.1665795894e-2f));
  y = fma(y, x, set1(1.6666665459e-1f));
  y = fma(y, x, set1(5.0000001201e-1f));
  y = add(fma(y, mul(x, x), x), set1(1.0f));
  return below(in, LOW, mul(y, pow2(n)));
}

inline float get(const float* p) { return *p; }
inline float get(const c10::BFloat16* p) { return static_cast<float>(*p); }

constexpr int RB = 4;                   // rows a task: one key/value head's rows, sharing every key and value read
constexpr int NK = V == 16 ? 4 : 2;     // keys scored at once (AVX2's 16 registers take 4 rows of 2)
constexpr int REGS = V == 16 ? 16 : 8;  // value accumulators kept in registers, at most

// Scores of NR rows (fp32 queries qs[r], [D]) against N keys: each one fp32 dot product (lanes over d in order,
// summed by halves, then the tail), the same arithmetic however many rows and keys run beside it.
template <int NR, int N, typename T>
inline void scores(const float* const* qs, const T* k, int64_t step, int64_t D, float* const* out) {
  Reg acc[NR][N];
  for (int r = 0; r < NR; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = zero();
  int64_t d = 0;
  for (; d + V <= D; d += V) {
    Reg kv[N];
    for (int n = 0; n < N; ++n) kv[n] = loadf(k + n * step + d);
    for (int r = 0; r < NR; ++r) {
      const Reg qv = loadf(qs[r] + d);
      for (int n = 0; n < N; ++n) acc[r][n] = fma(qv, kv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int n = 0; n < N; ++n) {
      float s = hsum(acc[r][n]);
      for (int64_t e = d; e < D; ++e) s = std::fma(qs[r][e], get(k + n * step + e), s);
      out[r][n] = s;
    }
}

// acc[r][0..D) = sum over the keys in order of p[r][j] * v[j] (an unseen key's p is 0 and adds nothing), the
// accumulators in registers where NR x NC fit, in memory otherwise: the same fused multiply-adds either way.
template <int NR, int NC, typename T>
inline void values(const float* const* p, const T* v, int64_t step, int64_t L, int64_t D, float* const* acc) {
  if constexpr (NC > 0 && NR * NC <= REGS) {
    Reg a[NR][NC];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) a[r][c] = zero();
    for (int64_t j = 0; j < L; ++j) {
      Reg vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = loadf(v + j * step + c * V);
      for (int r = 0; r < NR; ++r) {
        const Reg pv = set1(p[r][j]);
        for (int c = 0; c < NC; ++c) a[r][c] = fma(pv, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) store(acc[r] + c * V, a[r][c]);
  } else {
    for (int r = 0; r < NR; ++r) std::fill(acc[r], acc[r] + D, 0.0f);
    for (int64_t j = 0; j < L; ++j) {
      const T* vj = v + j * step;
      for (int r = 0; r < NR; ++r) {
        const Reg pv = set1(p[r][j]);
        int64_t d = 0;
        for (; d + V <= D; d += V) store(acc[r] + d, fma(pv, loadf(vj + d), loadf(acc[r] + d)));
        for (; d < D; ++d) acc[r][d] = std::fma(p[r][j], get(vj + d), acc[r][d]);
      }
    }
  }
}

template <int NR, typename T>
void values_of(const float* const* p, const T* v, int64_t step, int64_t L, int64_t D, float* const* acc) {
  switch (D == V ? 1 : D == 2 * V ? 2 : D == 4 * V ? 4 : D == 8 * V ? 8 : 0) {
    case 1: return values<NR, 1>(p, v, step, L, D, acc);
    case 2: return values<NR, 2>(p, v, step, L, D, acc);
    case 4: return values<NR, 4>(p, v, step, L, D, acc);
    case 8: return values<NR, 8>(p, v, step, L, D, acc);
    default: return values<NR, 0>(p, v, step, L, D, acc);
  }
}

struct Rows {  // one task's rows: where their queries, masks and outputs are
  int64_t b, g, first, count;
};

template <int NR, typename T>
void task(const Rows& rows, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
          const std::optional<at::Tensor>& mask, float scale, at::Tensor& out, std::vector<float>& buffer) {
  const int64_t H = q.size(1), Q = q.size(2), D = q.size(3), L = k.size(2), groups = H / k.size(1);
  const int64_t padded = (L + V - 1) / V * V;
  const float NEG = -std::numeric_limits<float>::infinity();
  buffer.resize(NR * (padded + 2 * D));
  float *query[NR], *score[NR], *acc[NR];
  int64_t head[NR], t[NR];
  for (int r = 0; r < NR; ++r) {
    query[r] = buffer.data() + r * (padded + 2 * D);
    acc[r] = query[r] + D;
    score[r] = acc[r] + D;
    const int64_t i = rows.first + r;
    head[r] = rows.g * groups + i / Q;
    t[r] = i % Q;
    const T* qr = q.const_data_ptr<T>() + rows.b * q.stride(0) + head[r] * q.stride(1) + t[r] * q.stride(2);
    for (int64_t d = 0; d < D; ++d) query[r][d] = get(qr + d);
  }
  const T* kr = k.const_data_ptr<T>() + rows.b * k.stride(0) + rows.g * k.stride(1);
  const T* vr = v.const_data_ptr<T>() + rows.b * v.stride(0) + rows.g * v.stride(1);
  const int64_t ks = k.stride(2);
  int64_t j = 0;
  for (; j + NK <= L; j += NK) {
    float* at[NR];
    for (int r = 0; r < NR; ++r) at[r] = score[r] + j;
    scores<NR, NK>(query, kr + j * ks, ks, D, at);
  }
  for (; j < L; ++j) {
    float* at[NR];
    for (int r = 0; r < NR; ++r) at[r] = score[r] + j;
    scores<NR, 1>(query, kr + j * ks, ks, D, at);
  }
  const bool boolean = mask && mask->scalar_type() == at::kBool;
  const bool* seen = boolean ? mask->const_data_ptr<bool>() : nullptr;
  const T* added = mask && !boolean ? mask->const_data_ptr<T>() : nullptr;
  for (int r = 0; r < NR; ++r) {  // scaled, masked, then each row's softmax weights (unnormalised)
    int64_t moff = 0, ml = 0;
    if (mask) {
      moff = (mask->size(0) > 1 ? rows.b * mask->stride(0) : 0) + (mask->size(1) > 1 ? head[r] * mask->stride(1) : 0) +
             t[r] * mask->stride(2);
      ml = mask->stride(3);
    }
    for (j = 0; j < L; ++j) {
      // one rounding either way: a mask's 0 gives the plain product's bits, as a row without a mask has them
      const float m = added ? get(added + moff + j * ml) : 0.0f;
      const float s = std::fma(score[r][j], scale, m);
      score[r][j] = seen && !seen[moff + j * ml] ? NEG : s;
    }
    for (j = L; j < padded; ++j) score[r][j] = NEG;
    Reg top = set1(NEG);  // a maximum in any order is the same number
    for (j = 0; j < padded; j += V) top = vmax(top, loadf(score[r] + j));
    float most = hmax(top);
    if (most == NEG) most = 0.0f;  // a row that sees nothing: every weight 0, the output 0 (below)
    const Reg shift = set1(most);
    for (j = 0; j < padded; j += V) store(score[r] + j, vexp(sub(loadf(score[r] + j), shift)));
  }
  float total[NR] = {};
  for (j = 0; j < L; ++j)  // each row's weights summed in key order (an unseen key adds 0); the rows side by side
    for (int r = 0; r < NR; ++r) total[r] += score[r][j];
  values_of<NR>(score, vr, v.stride(2), L, D, acc);
  for (int r = 0; r < NR; ++r) {
    const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    T* orow = out.mutable_data_ptr<T>() + ((rows.b * Q + t[r]) * H + head[r]) * D;
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[r][d] * inv);
  }
}

template <typename T>
void rows_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
             double scale, at::Tensor& out) {
  const int64_t B = q.size(0), KVH = k.size(1), per = q.size(1) / KVH * q.size(2), chunks = (per + RB - 1) / RB;
  at::parallel_for(0, B * KVH * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buffer;
    const float sc = static_cast<float>(scale);
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t first = (i % chunks) * RB;
      const Rows rows{i / (KVH * chunks), (i / chunks) % KVH, first, std::min<int64_t>(RB, per - first)};
      switch (rows.count) {
        case 1: task<1, T>(rows, q, k, v, mask, sc, out, buffer); break;
        case 2: task<2, T>(rows, q, k, v, mask, sc, out, buffer); break;
        case 3: task<3, T>(rows, q, k, v, mask, sc, out, buffer); break;
        default: task<4, T>(rows, q, k, v, mask, sc, out, buffer);
      }
    }
  });
}
}  // namespace

static at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "specviz_rows::attend: q [B, H, Q, D], k and v [B, KVH, L, D] with H a multiple of KVH");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "specviz_rows::attend: q, k and v fp32 or bf16 alike");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "specviz_rows::attend: last dimension contiguous");
  if (mask) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == q.size(0)) &&
                    (m.size(1) == 1 || m.size(1) == q.size(1)) && m.size(2) == q.size(2) && m.size(3) == k.size(2) &&
                    (m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type()),
                "specviz_rows::attend: mask [1 or B, 1 or H, Q, L], boolean or in q's dtype");
  }
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat)
    rows_of<float>(q, k, v, mask, scale, out);
  else
    rows_of<c10::BFloat16>(q, k, v, mask, scale, out);
  return out;
}

TORCH_LIBRARY_FRAGMENT(specviz_rows, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.impl("attend", c10::DispatchKey::CPU, TORCH_FN(attend));
}
