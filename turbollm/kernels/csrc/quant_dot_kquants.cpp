// Q4_K, Q5_K, Q6_K (256-weight super-blocks): row dot products with activations quantized per
// 256 (one scale dx per super-block, integer sums bs16 of each 16) and bit-exact row
// dequantization. Block layouts: formats/ggml_types/kquants.py.
//
// Q4_K / Q5_K: 8 sub-blocks of 32, w = (d sc_j) q - (dmin m_j), so per super-block
//   w . x = d dx sum_j sc_j (q_j . qx_j)  -  dmin dx sum_j m_j (bs16_2j + bs16_2j+1)
// Q6_K: 16 sub-blocks of 16, w = (d sc_j) (q - 32) with unsigned 6-bit q, so
//   w . x = d dx (sum_j sc_j (q_j . qx_j) - 32 sum_j sc_j bs16_j)
// Both integer sums are built in int32 (maddubs u8 x s8, then madd with the int16 scales,
// which also multiplies the sub-block scale in) and converted to float once per super-block.
#include "kquant_bits.h"

namespace tq {
namespace {

// ---- dequantization (same fp32 operations as the PyTorch decoders) --------------------------

template <bool Q5>
void deq_k45_scalar(const WView& w, int64_t n, float* out) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += kBytes, out += 256) {
    const float d = fp16_to_fp32(row), dmin = fp16_to_fp32(row + 2);
    uint8_t sc[8], mn[8];
    unpack_k4_scales(row + 4, sc, mn);
    const uint8_t* qh = row + 16;
    const uint8_t* qs = row + (Q5 ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
      const uint8_t* src = qs + 32 * (j / 2);
      for (int i = 0; i < 32; ++i) {
        int q = (j & 1) ? (src[i] >> 4) : (src[i] & 0x0F);
        if (Q5) q |= ((qh[i] >> j) & 1) << 4;
        out[32 * j + i] = (float)q * dl - ml;
      }
    }
  }
}

[[maybe_unused]] void deq_q6_k_scalar(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += 210, out += 256) {
    const uint8_t *ql = row, *qh = row + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    const float d = fp16_to_fp32(row + 208);
    float dl[16];
    for (int j = 0; j < 16; ++j) dl[j] = d * (float)sc[j];
    for (int h = 0; h < 2; ++h) {
      for (int p = 0; p < 4; ++p) {
        const uint8_t* lo = ql + 64 * h + 32 * (p & 1);
        for (int i = 0; i < 32; ++i) {
          const int low = (p < 2) ? (lo[i] & 0x0F) : (lo[i] >> 4);
          const int high = (qh[32 * h + i] >> (2 * p)) & 3;
          const int e = 128 * h + 32 * p + i;
          out[e] = (float)((low | (high << 4)) - 32) * dl[e / 16];
        }
      }
    }
  }
}

#ifdef __AVX2__
// ---- dot products --------------------------------------------------------------------------

template <bool Q5, int T, int R>
static inline void k45_run(const K45Block<Q5>& k, const int8_t* const* xq, int64_t xoff, __m256i* isum) {
  __m256i lo, hi;
  k.template codes<R>(lo, hi);
  const __m256i slo = bcast_i16<2 * R>(k.scv), shi = bcast_i16<2 * R + 1>(k.scv);
  for (int t = 0; t < T; ++t) {
    const int8_t* x = xq[t] + xoff + 64 * R;
    const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
    isum[t] = madd_add(madd_add(isum[t], _mm256_maddubs_epi16(lo, xl), slo), _mm256_maddubs_epi16(hi, xh), shi);
  }
}

template <bool Q5, int T>
void dot_k45(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int8_t* xq[T];
  const float* xd[T];
  const int16_t* xb[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) { xq[t] = a.qrow(m0 + t); xd[t] = a.drow(m0 + t); xb[t] = a.bs16row(m0 + t); }
  for (int64_t sb = 0; sb < w.K / 256; ++sb) {
    const K45Block<Q5> k(row + sb * K45Block<Q5>::kBytes);
    const __m128i mn = _mm_cvtepu8_epi16(_mm_srli_si128(k.scm, 8));
    const __m256i mn2 = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));  // m_j twice
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
    const int64_t xoff = sb * 256;
    k45_run<Q5, T, 0>(k, xq, xoff, isum);
    k45_run<Q5, T, 1>(k, xq, xoff, isum);
    k45_run<Q5, T, 2>(k, xq, xoff, isum);
    k45_run<Q5, T, 3>(k, xq, xoff, isum);
    for (int t = 0; t < T; ++t) {
      const float dx = xd[t][sb];
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[t] + sb * 16));
      const __m256i imin = _mm256_madd_epi16(bs, mn2);
      acc.at(t, 0) = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(k.d * dx), acc.at(t, 0));
      acc.at(t, 1) = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_set1_ps(k.dmin * dx), acc.at(t, 1));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t);
}

// int16 scale pair of 32-block p: low lane sc[2p] x8, high lane sc[2p+1] x8 (the 8 scales of
// the half as int16 in both lanes).
template <int P>
static inline __m256i q6_scale_pair(__m256i sc8) {
  const char a = (char)(4 * P), b = (char)(4 * P + 1), c = (char)(4 * P + 2), e = (char)(4 * P + 3);
  const __m256i mask = _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,
                                        c, e, c, e, c, e, c, e, c, e, c, e, c, e, c, e);
  return _mm256_shuffle_epi8(sc8, mask);
}

template <int T, int P>
static inline void q6_block(__m256i q, __m256i scv, const int8_t* const* xq, int64_t xoff, __m256i* isum) {
  const __m256i sp = q6_scale_pair<P>(scv);
  for (int t = 0; t < T; ++t) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + xoff + 32 * P));
    isum[t] = madd_add(isum[t], _mm256_maddubs_epi16(q, x), sp);
  }
}

template <int T>
void dot_q6_k(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int8_t* xq[T];
  const float* xd[T];
  const int16_t* xb[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) { xq[t] = a.qrow(m0 + t); xd[t] = a.drow(m0 + t); xb[t] = a.bs16row(m0 + t); }
  for (int64_t sb = 0; sb < w.K / 256; ++sb) {
    const uint8_t* blk = row + sb * 210;
    prefetch_ahead(blk, 3);
    const uint8_t *ql = blk, *qh = blk + 128;
    const float d = fp16_to_fp32(blk + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    __m256i isum[T];
    for (int t = 0; t < T; ++t) {  // the -32 offset: -32 sum_j sc_j bs16_j
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[t] + sb * 16));
      isum[t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i scv = h ? _mm256_permute4x64_epi64(sc16, 0xEE) : _mm256_permute4x64_epi64(sc16, 0x44);
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
      const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      const int64_t xoff = sb * 256 + 128 * h;
      q6_block<T, 0>(q6_quants<0>(q1, q2, hb), scv, xq, xoff, isum);
      q6_block<T, 1>(q6_quants<1>(q1, q2, hb), scv, xq, xoff, isum);
      q6_block<T, 2>(q6_quants<2>(q1, q2, hb), scv, xq, xoff, isum);
      q6_block<T, 3>(q6_quants<3>(q1, q2, hb), scv, xq, xoff, isum);
    }
    for (int t = 0; t < T; ++t) {
      acc.at(t, 0) = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * xd[t][sb]), acc.at(t, 0));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t);
}

// ---- AVX2 dequantization (same fp32 operations as the scalar forms above) -------------------

template <bool Q5, int R>
static inline void k45_deq_run(const uint8_t* qs, __m256i hb, const float* dl, const float* ml, float* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * R));
  __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  if constexpr (Q5) {
    lo = _mm256_or_si256(lo, bit_to_0x10<2 * R>(hb));
    hi = _mm256_or_si256(hi, bit_to_0x10<2 * R + 1>(hb));
  }
  deq32<Aff::MulSub, false>(lo, _mm256_set1_ps(dl[2 * R]), _mm256_set1_ps(ml[2 * R]), out + 64 * R);
  deq32<Aff::MulSub, false>(hi, _mm256_set1_ps(dl[2 * R + 1]), _mm256_set1_ps(ml[2 * R + 1]), out + 64 * R + 32);
}

template <bool Q5>
void deq_k45(const WView& w, int64_t n, float* out) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += kBytes, out += 256) {
    const float d = fp16_to_fp32(row), dmin = fp16_to_fp32(row + 2);
    uint8_t sc[8], mn[8];
    unpack_k4_scales(row + 4, sc, mn);
    float dl[8], ml[8];
    for (int j = 0; j < 8; ++j) { dl[j] = d * (float)sc[j]; ml[j] = dmin * (float)mn[j]; }
    const uint8_t* qs = row + (Q5 ? 48 : 16);
    const __m256i hb = Q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)) : _mm256_setzero_si256();
    k45_deq_run<Q5, 0>(qs, hb, dl, ml, out);
    k45_deq_run<Q5, 1>(qs, hb, dl, ml, out);
    k45_deq_run<Q5, 2>(qs, hb, dl, ml, out);
    k45_deq_run<Q5, 3>(qs, hb, dl, ml, out);
  }
}

template <int P>
static inline void q6_deq_block(__m256i q1, __m256i q2, __m256i hb, const float* dl, float* out) {
  const __m256i q = _mm256_sub_epi8(q6_quants<P>(q1, q2, hb), _mm256_set1_epi8(32));
  const __m256 z = _mm256_setzero_ps();
  deq32<Aff::Mul, true>(q, _mm256_set1_ps(dl[2 * P]), z, _mm256_set1_ps(dl[2 * P + 1]), z, out + 32 * P);
}

void deq_q6_k(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += 210, out += 256) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    const float d = fp16_to_fp32(row + 208);
    float dl[16];
    for (int j = 0; j < 16; ++j) dl[j] = d * (float)sc[j];
    for (int h = 0; h < 2; ++h) {
      const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 64 * h));
      const __m256i q2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 128 + 32 * h));
      q6_deq_block<0>(q1, q2, hb, dl + 8 * h, out + 128 * h);
      q6_deq_block<1>(q1, q2, hb, dl + 8 * h, out + 128 * h);
      q6_deq_block<2>(q1, q2, hb, dl + 8 * h, out + 128 * h);
      q6_deq_block<3>(q1, q2, hb, dl + 8 * h, out + 128 * h);
    }
  }
}

#define TQ_FILL(k, fn) \
  do {                                                                                         \
    (k).dot[0] = fn<1>; (k).dot[1] = fn<2>; (k).dot[2] = fn<3>; (k).dot[3] = fn<4>;             \
    (k).dot[4] = fn<5>; (k).dot[5] = fn<6>; (k).dot[6] = fn<7>; (k).dot[7] = fn<8>;             \
  } while (0)
template <int T> void dot_q4_k(const WView& w, int64_t n, const QAct& a, int64_t m0, float* o, int64_t s) {
  dot_k45<false, T>(w, n, a, m0, o, s);
}
template <int T> void dot_q5_k(const WView& w, int64_t n, const QAct& a, int64_t m0, float* o, int64_t s) {
  dot_k45<true, T>(w, n, a, m0, o, s);
}
#else
#define TQ_FILL(k, fn) do { } while (0)
#endif

}  // namespace

void register_kquants(TypeKernels* table) {
  TypeKernels& q4 = table[table_index(kQ4_K)];
  q4.block = 256; q4.bytes = 144; q4.act_block = 256;
  TypeKernels& q5 = table[table_index(kQ5_K)];
  q5.block = 256; q5.bytes = 176; q5.act_block = 256;
  TypeKernels& q6 = table[table_index(kQ6_K)];
  q6.block = 256; q6.bytes = 210; q6.act_block = 256;
#ifdef __AVX2__
  q4.deq = deq_k45<false>; q5.deq = deq_k45<true>; q6.deq = deq_q6_k;
  TQ_FILL(q4, dot_q4_k);
  TQ_FILL(q5, dot_q5_k);
  TQ_FILL(q6, dot_q6_k);
#else
  q4.deq = deq_k45_scalar<false>; q5.deq = deq_k45_scalar<true>; q6.deq = deq_q6_k_scalar;
  q4.dot[0] = dot_via_deq<deq_k45_scalar<false>, 1>; q4.dot[1] = dot_via_deq<deq_k45_scalar<false>, 2>;
  q4.dot[2] = dot_via_deq<deq_k45_scalar<false>, 3>; q4.dot[3] = dot_via_deq<deq_k45_scalar<false>, 4>;
  q5.dot[0] = dot_via_deq<deq_k45_scalar<true>, 1>; q5.dot[1] = dot_via_deq<deq_k45_scalar<true>, 2>;
  q5.dot[2] = dot_via_deq<deq_k45_scalar<true>, 3>; q5.dot[3] = dot_via_deq<deq_k45_scalar<true>, 4>;
  q6.dot[0] = dot_via_deq<deq_q6_k_scalar, 1>; q6.dot[1] = dot_via_deq<deq_q6_k_scalar, 2>;
  q6.dot[2] = dot_via_deq<deq_q6_k_scalar, 3>; q6.dot[3] = dot_via_deq<deq_q6_k_scalar, 4>;
#endif
}

}  // namespace tq
