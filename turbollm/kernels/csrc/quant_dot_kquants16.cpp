// Q4_K, Q5_K, Q6_K with 16-bit activations ("q16", blocks of 256: one scale dx per super-block,
// s32 = dx * the integer sum of each 32 values; quant_act.cpp).
//
// Each call widens a super-block's codes to int16 once and multiplies them by their sub-block's
// integer scale (Q4_K / Q5_K: sc_j q, |.| <= 63 * 31 = 1953, one maddubs per 16 codes; Q6_K:
// sc_j (q - 32), |.| <= 128 * 32 = 4096); every token of the call then meets them in madd_add (one VNNI dpwssd per 16 values where
// the CPU has it), so
//   Q4_K / Q5_K: w . x = d dx sum_j (sc_j q_j) . qx_j  -  dmin sum_j m_j s32_j
//   Q6_K:        w . x = d dx sum_j (sc_j (q_j - 32)) . qx_j
// An int32 lane sums 32 products of a Q4_K / Q5_K super-block (< 32 * 1953 * 32767 < 2^31) or 16
// of a Q6_K half super-block (<= 16 * 4096 * 32767 < 2^31): converted to float once per super-block
// (half for Q6_K). One 16-bit level has about the precision of q8x2's two 8-bit ones at half the
// integer work per token: the verification and batched steps of k-quant models are made of it.
// Reference: kernels/quant.py (q8_linear_ref with levels=16, block 256); tests/test_quant_kernels.py.
#include "kquant_bits.h"

namespace tq {
namespace {

#ifdef __AVX2__
// 32 u8 codes -> two int16 vectors, minus `off`: codes 0-15 times the scale s0, 16-31 times s1.
static inline void widen_scaled(__m256i q, __m256i off, __m256i s0, __m256i s1, __m256i& w0, __m256i& w1) {
  w0 = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), off), s0);
  w1 = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), off), s1);
}

static inline __m256i load16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Sub-blocks 2R and 2R + 1 of a Q4_K / Q5_K super-block (the low and high nibbles of qs[32R..]).
// maddubs with the byte pattern (sc, 0, sc, 0, ...) -- a sub-block scale as int16 -- gives the even
// codes times sc as 16 int16, with (0, sc, ...) the odd ones: the widening and the scaling in one
// instruction, no lane crossing; the activations come in the same order (act16_even_odd: each 32 as
// its 16 even-indexed values, then its 16 odd ones).
template <bool Q5, int T, int R>
static inline void k45_run16(const K45Block<Q5>& k, const int16_t* const* xq, int64_t xoff, __m256i* isum) {
  __m256i lo, hi;
  k.template codes<R>(lo, hi);
  const __m256i slo = bcast_i16<2 * R>(k.scv), shi = bcast_i16<2 * R + 1>(k.scv);  // bytes (sc, 0, sc, 0, ...)
  const __m256i le = _mm256_maddubs_epi16(lo, slo), lo_odd = _mm256_maddubs_epi16(lo, _mm256_slli_epi16(slo, 8));
  const __m256i he = _mm256_maddubs_epi16(hi, shi), hi_odd = _mm256_maddubs_epi16(hi, _mm256_slli_epi16(shi, 8));
  for (int t = 0; t < T; ++t) {
    const int16_t* x = xq[t] + xoff + 64 * R;
    isum[t] = madd_add(madd_add(isum[t], le, load16(x)), lo_odd, load16(x + 16));
    isum[t] = madd_add(madd_add(isum[t], he, load16(x + 32)), hi_odd, load16(x + 48));
  }
}

template <bool Q5, int T>
void dot_k45_16(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int16_t* xq[T];
  const float *xd[T], *xs[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) { xq[t] = a.q16row(m0 + t); xd[t] = a.drow(m0 + t); xs[t] = a.s32row(m0 + t); }
  for (int64_t sb = 0; sb < w.K / 256; ++sb) {
    const K45Block<Q5> k(row + sb * K45Block<Q5>::kBytes);
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(k.scm, 8)));
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
    const int64_t xoff = sb * 256;
    k45_run16<Q5, T, 0>(k, xq, xoff, isum);
    k45_run16<Q5, T, 1>(k, xq, xoff, isum);
    k45_run16<Q5, T, 2>(k, xq, xoff, isum);
    k45_run16<Q5, T, 3>(k, xq, xoff, isum);
    for (int t = 0; t < T; ++t) {
      acc.at(t, 0) = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(k.d * xd[t][sb]), acc.at(t, 0));
      const __m256 m = _mm256_mul_ps(mins, _mm256_loadu_ps(xs[t] + sb * 8));
      acc.at(t, 1) = _mm256_fnmadd_ps(m, _mm256_set1_ps(k.dmin), acc.at(t, 1));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t);
}

// 32-block P (0..3) of a Q6_K half: its first 16 codes take scale sc[2P], the last 16 sc[2P + 1].
// scv: the half's 8 scales as int16 in both lanes.
template <int T, int P>
static inline void q6_run16(__m256i q1, __m256i q2, __m256i hb, __m256i scv, const int16_t* const* xq,
                            int64_t xoff, __m256i* isum) {
  const __m256i off = _mm256_set1_epi16(32);
  __m256i w0, w1;
  widen_scaled(q6_quants<P>(q1, q2, hb), off, bcast_i16<2 * P>(scv), bcast_i16<2 * P + 1>(scv), w0, w1);
  for (int t = 0; t < T; ++t) {
    const int16_t* x = xq[t] + xoff + 32 * P;
    isum[t] = madd_add(madd_add(isum[t], w0, load16(x)), w1, load16(x + 16));
  }
}

template <int T>
void dot_q6_k_16(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int16_t* xq[T];
  const float* xd[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) { xq[t] = a.q16row(m0 + t); xd[t] = a.drow(m0 + t); }
  for (int64_t sb = 0; sb < w.K / 256; ++sb) {
    const uint8_t* blk = row + sb * 210;
    prefetch_ahead(blk, 3);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const float d = fp16_to_fp32(blk + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i scv = h ? _mm256_permute4x64_epi64(sc16, 0xEE) : _mm256_permute4x64_epi64(sc16, 0x44);
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      __m256i isum[T];
      for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
      const int64_t xoff = sb * 256 + 128 * h;
      q6_run16<T, 0>(q1, q2, hb, scv, xq, xoff, isum);
      q6_run16<T, 1>(q1, q2, hb, scv, xq, xoff, isum);
      q6_run16<T, 2>(q1, q2, hb, scv, xq, xoff, isum);
      q6_run16<T, 3>(q1, q2, hb, scv, xq, xoff, isum);
      for (int t = 0; t < T; ++t)
        acc.at(t, h) = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * xd[t][sb]), acc.at(t, h));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t);
}

template <int T> void dot_q4_k_16(const WView& w, int64_t n, const QAct& a, int64_t m0, float* o, int64_t s) {
  dot_k45_16<false, T>(w, n, a, m0, o, s);
}
template <int T> void dot_q5_k_16(const WView& w, int64_t n, const QAct& a, int64_t m0, float* o, int64_t s) {
  dot_k45_16<true, T>(w, n, a, m0, o, s);
}

#define TQ_FILL16(k, fn)                                                                        \
  do {                                                                                          \
    (k).dot16[0] = fn<1>; (k).dot16[1] = fn<2>; (k).dot16[2] = fn<3>; (k).dot16[3] = fn<4>;     \
    (k).dot16[4] = fn<5>; (k).dot16[5] = fn<6>; (k).dot16[6] = fn<7>; (k).dot16[7] = fn<8>;     \
  } while (0)
#endif

}  // namespace

void register_kquants16(TypeKernels* table) {
#ifdef __AVX2__
  TQ_FILL16(table[table_index(kQ4_K)], dot_q4_k_16);
  TQ_FILL16(table[table_index(kQ5_K)], dot_q5_k_16);
  table[table_index(kQ4_K)].act16_even_odd = table[table_index(kQ5_K)].act16_even_odd = true;
  TQ_FILL16(table[table_index(kQ6_K)], dot_q6_k_16);
#else
  (void)table;
#endif
}

}  // namespace tq
