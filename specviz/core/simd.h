// The vector registers the rows extension's kernels compute with (rows.cpp, attend.cpp): the widest the build's
// -march=native allows of AVX-512 and AVX2 (core/rows.py builds only where AVX2 and FMA are), as the vector type
// itself: GCC kept arrays of ATen's Vectorized wrapper on the stack (a load and a store beside every FMA) once a
// block held more than 16 of them.
#pragma once
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace simd {
#if defined(__AVX512F__)
using Reg = __m512;
constexpr int V = 16;
inline Reg loadf(const float* p) { return _mm512_loadu_ps(p); }
inline Reg loadf(const c10::BFloat16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
inline Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
inline Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
inline Reg set1(float x) { return _mm512_set1_ps(x); }
inline Reg zero() { return _mm512_setzero_ps(); }
inline Reg vmin(Reg a, Reg b) { return _mm512_min_ps(a, b); }
inline Reg vmax(Reg a, Reg b) { return _mm512_max_ps(a, b); }
inline Reg floor(Reg a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline Reg pow2(Reg n) {  // 2^n for whole n in [-127, 128]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline Reg below(Reg x, float limit, Reg y) {  // y where x >= limit, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(limit), _CMP_GE_OQ), y);
}
inline float hsum(Reg v) { return _mm512_reduce_add_ps(v); }  // the lanes summed by halves
inline float hmax(Reg v) { return _mm512_reduce_max_ps(v); }
#else
using Reg = __m256;
constexpr int V = 8;
inline Reg loadf(const float* p) { return _mm256_loadu_ps(p); }
inline Reg loadf(const c10::BFloat16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
inline Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
inline Reg set1(float x) { return _mm256_set1_ps(x); }
inline Reg zero() { return _mm256_setzero_ps(); }
inline Reg vmin(Reg a, Reg b) { return _mm256_min_ps(a, b); }
inline Reg vmax(Reg a, Reg b) { return _mm256_max_ps(a, b); }
inline Reg floor(Reg a) { return _mm256_floor_ps(a); }
inline Reg pow2(Reg n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Reg below(Reg x, float limit, Reg y) { return _mm256_and_ps(_mm256_cmp_ps(x, set1(limit), _CMP_GE_OQ), y); }
inline float hsum(Reg v) {  // the lanes summed by halves: (l, l + 4), then (l, l + 2), then (l, l + 1)
  __m128 h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
inline float hmax(Reg v) {
  __m128 h = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#endif
}  // namespace simd
