// Bit and nibble unpacking shared by the k-quant kernels (quant_dot_kquants.cpp: int8
// activations and dequantization; quant_dot_kquants16.cpp: 16-bit activations).
#pragma once
#include "quant_common.h"

namespace tq {
#ifdef __AVX2__
// Bit K of every byte of v moved to bit 4 (0x10 or 0).
template <int K>
static inline __m256i bit_to_0x10(__m256i v) {
  const __m256i m = _mm256_set1_epi8(0x10);
  if constexpr (K < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - K), m);
  else if constexpr (K == 4) return _mm256_and_si256(v, m);
  else return _mm256_and_si256(_mm256_srli_epi16(v, K - 4), m);
}

// 6-bit quants of 32-block p (0..3) of a Q6_K half: low nibbles from q1/q2, 2 high bits from hb.
template <int P>
static inline __m256i q6_quants(__m256i q1, __m256i q2, __m256i hb) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i src = (P & 1) ? q2 : q1;
  const __m256i low = (P < 2) ? _mm256_and_si256(src, m4) : _mm256_and_si256(_mm256_srli_epi16(src, 4), m4);
  __m256i high;
  if constexpr (P == 0) high = _mm256_slli_epi16(hb, 4);
  else if constexpr (P == 1) high = _mm256_slli_epi16(hb, 2);
  else if constexpr (P == 2) high = hb;
  else high = _mm256_srli_epi16(hb, 2);
  return _mm256_or_si256(low, _mm256_and_si256(high, m30));
}

// int16 index J of each 128-bit lane broadcast over that lane (for a madd by one scale).
template <int J>
static inline __m256i bcast_i16(__m256i v) {
  const char a = (char)(2 * J), b = (char)(2 * J + 1);
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,
                                                 a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b));
}

#endif
}  // namespace tq
