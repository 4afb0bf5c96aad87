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

// The header of a Q4_K / Q5_K super-block, decoded once for either dot kernel (int8 or 16-bit
// activations), and the codes of its sub-blocks 2R (lo) and 2R + 1 (hi).
template <bool Q5>
struct K45Block {
  static constexpr int kBytes = Q5 ? 176 : 144;
  __m128i scm;  // bytes: 8 scales | 8 mins
  __m256i scv;  // the 8 scales as int16, in both lanes
  float d, dmin;
  const uint8_t* qs;  // the 4-bit codes
  __m256i hb;         // Q5_K's fifth bits (zero for Q4_K)
  explicit K45Block(const uint8_t* blk) {
    prefetch_ahead(blk, Q5 ? 3 : 2);
    scm = k4_scales_mins(blk + 4);
    scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)load_u32(blk)));  // d, dmin
    d = _mm_cvtss_f32(dd);
    dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
    qs = blk + (Q5 ? 48 : 16);
    hb = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
  }
  template <int R>
  inline void codes(__m256i& lo, __m256i& hi) const {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * R));
    lo = _mm256_and_si256(v, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if constexpr (Q5) {
      lo = _mm256_or_si256(lo, bit_to_0x10<2 * R>(hb));
      hi = _mm256_or_si256(hi, bit_to_0x10<2 * R + 1>(hb));
    }
  }
};

#endif
}  // namespace tq
