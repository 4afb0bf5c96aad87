// The AVX-512 form of dense_linear's pass over W (dense_gemv.cpp): the same outputs, bit for bit.
//
// Each output of the AVX2 pass keeps two 8-wide accumulators over k (lane j of the first holds the
// k = j mod 16 terms with j < 8, of the second those with j >= 8), then adds them lane by lane and sums the
// 8 lanes (tq::hsum). Here one 16-wide accumulator holds the very same 16 partial sums, each built by the
// same fused multiply-adds in the same k order; its two halves are added and summed by the same tq::hsum;
// the tail (K mod 16) runs the same scalar loop. So the result is the AVX2 pass's (tests/test_dense_gemv.py
// compares the two forms' bits), and the form is chosen by the CPU alone.
//
// What the wider registers buy is room: 4 rows of W by up to 4 rows of x (16 accumulators of 32) share each
// widened bfloat16 load and each row of x, where the AVX2 pass fits 4 x 1 (or 2 x 2). Measured (Xeon,
// 2026-12-06, scripts/bench_dense.py): 1.1-1.2x the AVX2 pass at 16 rows, 0.8-1.05x at one to eight (one row
// is bound by memory, and four streams of W prefetch no better than two), so dense_linear takes it from 12 rows.
//
// Compiled for AVX-512 F by the target pragma below (after the standard headers, as qmm_vnni512.cpp), called
// only when the CPU has it (dense_gemv.cpp).
#include <algorithm>
#include <cstdint>
#include <immintrin.h>

#include "quant_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace tq {
namespace v512 {
namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32: the 16 bits go to the top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

template <int T, int R, typename W>
inline void outputs(const W* w, const float* x, const float* bias, float* out, int64_t K, int64_t N, int64_t ldx,
                    int64_t n, int64_t ahead) {
  __m512 acc[R][T];
  for (int q = 0; q < R; ++q)
    for (int t = 0; t < T; ++t) acc[q][t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (n + R - 1) * K + k) + ahead, _MM_HINT_T0);
    __m512 wv[R];
    for (int q = 0; q < R; ++q) wv[q] = load16(w + (n + q) * K + k);
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * ldx + k);
      for (int q = 0; q < R; ++q) acc[q][t] = _mm512_fmadd_ps(wv[q], xv, acc[q][t]);
    }
  }
  for (int q = 0; q < R; ++q) {
    const W* r = w + (n + q) * K;
    for (int t = 0; t < T; ++t) {
      float s = hsum(_mm256_add_ps(_mm512_castps512_ps256(acc[q][t]),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[q][t]), 1))));
      for (int64_t kk = k; kk < K; ++kk) s += widen(r[kk]) * x[t * ldx + kk];
      out[t * N + n + q] = s + (bias ? bias[n + q] : 0.f);
    }
  }
}

template <int T, typename W>
void rows_of_w(const W* w, const float* x, const float* bias, float* out, int64_t K, int64_t N, int64_t ldx,
               int64_t n0, int64_t n1, int64_t ahead) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) outputs<T, 4>(w, x, bias, out, K, N, ldx, n, ahead);
  for (; n < n1; ++n) outputs<T, 1>(w, x, bias, out, K, N, ldx, n, ahead);
}

template <typename W>
void rows_any(int T, const W* w, const float* x, const float* bias, float* out, int64_t K, int64_t N, int64_t ldx,
              int64_t n0, int64_t n1, int64_t ahead) {
  switch (T) {
    case 1: rows_of_w<1>(w, x, bias, out, K, N, ldx, n0, n1, ahead); break;
    case 2: rows_of_w<2>(w, x, bias, out, K, N, ldx, n0, n1, ahead); break;
    case 3: rows_of_w<3>(w, x, bias, out, K, N, ldx, n0, n1, ahead); break;
    default: rows_of_w<4>(w, x, bias, out, K, N, ldx, n0, n1, ahead); break;
  }
}

}  // namespace

void dense_rows(int T, const float* w, const float* x, const float* bias, float* out, int64_t K, int64_t N,
                int64_t ldx, int64_t n0, int64_t n1, int64_t ahead) {
  rows_any(T, w, x, bias, out, K, N, ldx, n0, n1, ahead);
}

void dense_rows(int T, const uint16_t* w, const float* x, const float* bias, float* out, int64_t K, int64_t N,
                int64_t ldx, int64_t n0, int64_t n1, int64_t ahead) {
  rows_any(T, w, x, bias, out, K, N, ldx, n0, n1, ahead);
}

}  // namespace v512
}  // namespace tq

#pragma GCC pop_options
