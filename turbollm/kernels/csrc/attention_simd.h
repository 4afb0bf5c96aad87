// SIMD pieces of the paged attention kernels (paged_attention.cpp: decode; flash_attention.cpp:
// any number of new tokens): cache element loads, dot products against K rows, P·V accumulation.
// AVX2 with scalar fallbacks; static inline, so each kernel file has its own copy.
#pragma once
#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_math.h"

// Cache element types: float32, or float16 widened on load (F16C).
static inline float to_f32(float v) { return v; }
static inline float to_f32(at::Half v) { return static_cast<float>(v); }
static inline float to_f32(int8_t v) { return static_cast<float>(v); }  // int8 K/V (scales folded outside)
#ifdef __AVX2__
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// Software prefetch of `count` cache rows of `bytes` each: the rows of a paged cache are
// scattered blocks, which the hardware prefetcher follows poorly (cold caches ran at ~7 GB/s).
template <class T>
static inline void prefetch_rows(const T* const* rows, int64_t count, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + b, 0, 3);
}

template <class T>
static inline float dot(const float* a, const T* b, int64_t n) {
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += a[i] * to_f32(b[i]);
  return r;
#else
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * to_f32(b[i]);
  return r;
#endif
}

#ifdef __AVX2__
// Eight dot products q . k_j (j < 8) of length D (a multiple of 8) as one vector.
template <class T>
static inline __m256 dot8(const float* q, const T* const k[8], int64_t D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(k[j] + i), a[j]);
  }
  // transpose-reduce: lane j of the result is the sum of a[j]
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 = [0 1 2 3 | 0 1 2 3] halves (low lane: elements 0-3, high lane: 4-7 of each a)
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// acc[g][0:32) += sum_t p[g][t] * v_t[d0:d0+32) for NG heads at once (accumulators in registers).
template <int NG, class T>
static inline void accum_v32(const T* const* vrows, const float* p, int64_t pstride, int64_t n, int64_t d0,
                             float* acc, int64_t D) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + d0 + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    if (d0 == 0 && t + 8 < n) prefetch_rows(vrows + t + 8, 1, D * sizeof(T));
    const T* v = vrows[t] + d0;
    const __m256 v0 = load8(v), v1 = load8(v + 8), v2 = load8(v + 16), v3 = load8(v + 24);
    for (int g = 0; g < NG; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + g * pstride + t);
      a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
      a[g][2] = _mm256_fmadd_ps(w, v2, a[g][2]);
      a[g][3] = _mm256_fmadd_ps(w, v3, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, a[g][c]);
}
#endif

// acc[r] += sum_j p[r][j] * v_j for R rows (p: [R, n], row stride n; acc: [R, D]); registers
// hold three rows' 32-column slices at a time, the tail columns go scalar.
template <class T>
static inline void accum_pv(const T* const* vrows, const float* p, int64_t n, int64_t R, float* acc, int64_t D) {
  int64_t d0 = 0;
#ifdef __AVX2__
  for (; d0 + 32 <= D; d0 += 32) {
    int64_t r = 0;
    for (; r + 3 <= R; r += 3) accum_v32<3>(vrows, p + r * n, n, n, d0, acc + r * D, D);
    if (R - r == 2) accum_v32<2>(vrows, p + r * n, n, n, d0, acc + r * D, D);
    if (R - r == 1) accum_v32<1>(vrows, p + r * n, n, n, d0, acc + r * D, D);
  }
#endif
  if (d0 < D)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < R; ++r) {
        const float w = p[r * n + j];
        float* o = acc + r * D;
        for (int64_t d = d0; d < D; ++d) o[d] += w * to_f32(vrows[j][d]);
      }
}

// s[i] = exp(s[i] - mx) for i in [a, e); returns their sum (eight lanes, then the tail in order).
static inline float exp_sum(float* s, int64_t a, int64_t e, float mx) {
  float sum = 0.f;
  int64_t i = a;
#ifdef __AVX2__
  __m256 vs = _mm256_setzero_ps();
  for (; i + 8 <= e; i += 8) {
    const __m256 v = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(s + i, v);
    vs = _mm256_add_ps(vs, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vs);
  for (float f : lanes) sum += f;
#endif
  for (; i < e; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

// Row r's output from C partial results of a split over the keys: part c, at base + c * stride, holds
// m[R], l[R] and the unnormalized acc[R * D]; o = sum_c w_c acc_c[r] / sum_c w_c l_c[r] with
// w_c = exp(m_c[r] - max_c m_c[r]). o must be zero on entry; a part that saw none of the row's keys
// (m = -inf) adds nothing.
static inline void merge_parts_row(const float* base, int64_t stride, int64_t C, int64_t R, int64_t r, int64_t D,
                                   float* o) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t c = 0; c < C; ++c) mx = std::max(mx, base[c * stride + r]);
  float lsum = 0.f;
  for (int64_t c = 0; c < C; ++c) {
    const float* pc = base + c * stride;
    if (pc[r] == ninf) continue;
    const float w = std::exp(pc[r] - mx);
    lsum += w * pc[R + r];
    const float* a = pc + 2 * R + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
  }
  const float inv = 1.f / lsum;
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}
