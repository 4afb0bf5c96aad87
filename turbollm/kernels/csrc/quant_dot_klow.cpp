// Q2_K and Q3_K (256-weight super-blocks of 16 sub-blocks of 16): row dot products with Q8
// activations and bit-exact row dequantization. Block layouts: formats/ggml_types/kquants.py.
//
// Activations are quantized per 256 (one scale dx, integer sums bs16 of each 16), as for the
// other k-quants. Both types hold 2-bit planes in two runs of 32 bytes (run r, plane p = 32-block
// 4r + p); the int16 scale pair of a 32-block is applied by the madd.
// Q2_K: w = (d s_j) q - (dmin m_j): the mins are one madd of the 16 m_j with bs16.
// Q3_K: w = (d sc_j) (q' - 4) with q' = low2 | hbit << 2 in [0, 7] and signed 6-bit sc_j; the
//       -4 offset is  -4 sum_j sc_j bs16_j, in the same int32 sum.
#include "quant_common.h"

namespace tq {
namespace {

// The 16 signed 6-bit scales of a Q3_K super-block (12 packed bytes), minus 32.
static inline void unpack_q3_scales(const uint8_t* s, int8_t out[16]) {
  const uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), a2 = load_u32(s + 8);
  uint32_t v[4];
  v[0] = (a0 & 0x0F0F0F0Fu) | ((a2 & 0x03030303u) << 4);
  v[1] = (a1 & 0x0F0F0F0Fu) | (((a2 >> 2) & 0x03030303u) << 4);
  v[2] = ((a0 >> 4) & 0x0F0F0F0Fu) | (((a2 >> 4) & 0x03030303u) << 4);
  v[3] = ((a1 >> 4) & 0x0F0F0F0Fu) | (((a2 >> 6) & 0x03030303u) << 4);
  uint8_t u[16];
  std::memcpy(u, v, 16);
  for (int i = 0; i < 16; ++i) out[i] = (int8_t)(u[i] - 32);
}

// Element e of a super-block: 2-bit value of run e / 128, plane (e / 32) % 4, byte e % 32.
static inline int low2(const uint8_t* qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3; }

[[maybe_unused]] void deq_q2_k_scalar(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += 84, out += 256) {
    const float d = fp16_to_fp32(row + 80), dmin = fp16_to_fp32(row + 82);
    for (int e = 0; e < 256; ++e) {
      const uint8_t s = row[e / 16];
      const float dl = d * (float)(s & 0x0F), ml = dmin * (float)(s >> 4);
      out[e] = (float)low2(row + 16, e) * dl - ml;
    }
  }
}

[[maybe_unused]] void deq_q3_k_scalar(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += 110, out += 256) {
    int8_t sc[16];
    unpack_q3_scales(row + 96, sc);
    const float d = fp16_to_fp32(row + 108);
    for (int e = 0; e < 256; ++e) {
      const int h = (row[e % 32] >> (e / 32)) & 1;
      out[e] = (float)(low2(row + 32, e) + 4 * h - 4) * (d * (float)sc[e / 16]);
    }
  }
}

#ifdef __AVX2__
// Bit SRC of every byte moved to bit DST (others cleared).
template <int SRC, int DST>
static inline __m256i move_bit(__m256i v) {
  const __m256i m = _mm256_set1_epi8((char)(1 << DST));
  if constexpr (SRC < DST) return _mm256_and_si256(_mm256_slli_epi16(v, DST - SRC), m);
  else if constexpr (SRC == DST) return _mm256_and_si256(v, m);
  else return _mm256_and_si256(_mm256_srli_epi16(v, SRC - DST), m);
}

// int16 scale pair of 32-block p: low lane scale 2p x8, high lane scale 2p+1 x8 (sc8 in both lanes).
template <int P>
static inline __m256i scale_pair(__m256i sc8) {
  const char a = (char)(4 * P), b = (char)(4 * P + 1), c = (char)(4 * P + 2), e = (char)(4 * P + 3);
  const __m256i mask = _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b,
                                        c, e, c, e, c, e, c, e, c, e, c, e, c, e, c, e);
  return _mm256_shuffle_epi8(sc8, mask);
}

// 32-block P of run R: unsigned quants (Q2: low2; Q3: low2 | hbit << 2).
template <bool Q3, int R, int P>
static inline __m256i klow_quants(__m256i v, __m256i hb) {
  const __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * P), _mm256_set1_epi8(3));
  if constexpr (Q3) return _mm256_or_si256(q, move_bit<4 * R + P, 2>(hb));
  else return q;
}

template <bool Q3, int T, int R, int P>
static inline void klow_block(__m256i v, __m256i hb, __m256i sc8, const int8_t* const* xq, int64_t xoff,
                              __m256i* isum) {
  const __m256i q = klow_quants<Q3, R, P>(v, hb);
  const __m256i sp = scale_pair<P>(sc8);
  for (int t = 0; t < T; ++t) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + xoff + 128 * R + 32 * P));
    isum[t] = madd_add(isum[t], _mm256_maddubs_epi16(q, x), sp);
  }
}

template <bool Q3, int T, int R>
static inline void klow_run(const uint8_t* qs, __m256i hb, __m256i sc16, const int8_t* const* xq, int64_t xoff,
                            __m256i* isum) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * R));
  const __m256i sc8 = _mm256_permute4x64_epi64(sc16, R ? 0xEE : 0x44);  // scales 8R..8R+7 in both lanes
  klow_block<Q3, T, R, 0>(v, hb, sc8, xq, xoff, isum);
  klow_block<Q3, T, R, 1>(v, hb, sc8, xq, xoff, isum);
  klow_block<Q3, T, R, 2>(v, hb, sc8, xq, xoff, isum);
  klow_block<Q3, T, R, 3>(v, hb, sc8, xq, xoff, isum);
}

// Per super-block: isum = sum_j sc_j (q_j . qx_j) in int32, then
// Q2_K: d dx isum - dmin dx sum_j m_j bs16_j;  Q3_K: d dx (isum - 4 sum_j sc_j bs16_j).
template <bool Q3, int T>
void dot_klow(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  constexpr int kBytes = Q3 ? 110 : 84;
  const uint8_t* row = w.row(n);
  const int8_t* xq[T];
  const float* xd[T];
  const int16_t* xb[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) { xq[t] = a.qrow(m0 + t); xd[t] = a.drow(m0 + t); xb[t] = a.bs16row(m0 + t); }
  for (int64_t sb = 0; sb < w.K / 256; ++sb) {
    const uint8_t* blk = row + sb * kBytes;
    prefetch_ahead(blk, 2);
    __m256i sc16, mn16;  // the 16 sub-block scales (and Q2_K mins) as int16
    float d, dmin = 0.f;
    if constexpr (Q3) {
      int8_t s8[16];
      unpack_q3_scales(blk + 96, s8);
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s8)));
      mn16 = sc16;
      d = fp16_to_fp32(blk + 108);
    } else {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
      sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(0x0F)));
      mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)));
      d = fp16_to_fp32(blk + 80);
      dmin = fp16_to_fp32(blk + 82);
    }
    __m256i isum[T], ioff[T];
    for (int t = 0; t < T; ++t) {
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[t] + sb * 16));
      ioff[t] = _mm256_madd_epi16(bs, mn16);
      isum[t] = Q3 ? _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(ioff[t], 2)) : _mm256_setzero_si256();
    }
    const uint8_t* qs = blk + (Q3 ? 32 : 16);
    const __m256i hb = Q3 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)) : _mm256_setzero_si256();
    klow_run<Q3, T, 0>(qs, hb, sc16, xq, sb * 256, isum);
    klow_run<Q3, T, 1>(qs, hb, sc16, xq, sb * 256, isum);
    for (int t = 0; t < T; ++t) {
      const float dx = xd[t][sb];
      acc.at(t, 0) = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * dx), acc.at(t, 0));
      if constexpr (!Q3)
        acc.at(t, 1) = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ioff[t]), _mm256_set1_ps(dmin * dx), acc.at(t, 1));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t);
}

template <bool Q3, int R, int P>
static inline void klow_deq_block(__m256i v, __m256i hb, const float* dl, const float* ml, float* out) {
  const int j = 8 * R + 2 * P;  // first sub-block of the 32-block
  __m256i q = klow_quants<Q3, R, P>(v, hb);
  if constexpr (Q3) {
    const __m256 z = _mm256_setzero_ps();
    q = _mm256_sub_epi8(q, _mm256_set1_epi8(4));
    deq32<Aff::Mul, true>(q, _mm256_set1_ps(dl[j]), z, _mm256_set1_ps(dl[j + 1]), z, out + 128 * R + 32 * P);
  } else {
    deq32<Aff::MulSub, false>(q, _mm256_set1_ps(dl[j]), _mm256_set1_ps(ml[j]), _mm256_set1_ps(dl[j + 1]),
                              _mm256_set1_ps(ml[j + 1]), out + 128 * R + 32 * P);
  }
}

template <bool Q3, int R>
static inline void klow_deq_run(const uint8_t* qs, __m256i hb, const float* dl, const float* ml, float* out) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * R));
  klow_deq_block<Q3, R, 0>(v, hb, dl, ml, out);
  klow_deq_block<Q3, R, 1>(v, hb, dl, ml, out);
  klow_deq_block<Q3, R, 2>(v, hb, dl, ml, out);
  klow_deq_block<Q3, R, 3>(v, hb, dl, ml, out);
}

template <bool Q3>
void deq_klow(const WView& w, int64_t n, float* out) {
  constexpr int kBytes = Q3 ? 110 : 84;
  const uint8_t* row = w.row(n);
  for (int64_t sb = 0; sb < w.K / 256; ++sb, row += kBytes, out += 256) {
    float dl[16], ml[16];
    if constexpr (Q3) {
      int8_t sc[16];
      unpack_q3_scales(row + 96, sc);
      const float d = fp16_to_fp32(row + 108);
      for (int j = 0; j < 16; ++j) dl[j] = d * (float)sc[j];
    } else {
      const float d = fp16_to_fp32(row + 80), dmin = fp16_to_fp32(row + 82);
      for (int j = 0; j < 16; ++j) { dl[j] = d * (float)(row[j] & 0x0F); ml[j] = dmin * (float)(row[j] >> 4); }
    }
    const uint8_t* qs = row + (Q3 ? 32 : 16);
    const __m256i hb = Q3 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)) : _mm256_setzero_si256();
    klow_deq_run<Q3, 0>(qs, hb, dl, ml, out);
    klow_deq_run<Q3, 1>(qs, hb, dl, ml, out);
  }
}
#endif

}  // namespace

void register_kquants_low(TypeKernels* table) {
  TypeKernels& q2 = table[table_index(kQ2_K)];
  q2.block = 256; q2.bytes = 84; q2.act_block = 256;
  TypeKernels& q3 = table[table_index(kQ3_K)];
  q3.block = 256; q3.bytes = 110; q3.act_block = 256;
#ifdef __AVX2__
  q2.deq = deq_klow<false>; q3.deq = deq_klow<true>;
  q2.dot[0] = dot_klow<false, 1>; q2.dot[1] = dot_klow<false, 2>;
  q2.dot[2] = dot_klow<false, 3>; q2.dot[3] = dot_klow<false, 4>;
  q3.dot[0] = dot_klow<true, 1>; q3.dot[1] = dot_klow<true, 2>;
  q3.dot[2] = dot_klow<true, 3>; q3.dot[3] = dot_klow<true, 4>;
#else
  q2.deq = deq_q2_k_scalar; q3.deq = deq_q3_k_scalar;
  q2.dot[0] = dot_via_deq<deq_q2_k_scalar, 1>; q2.dot[1] = dot_via_deq<deq_q2_k_scalar, 2>;
  q2.dot[2] = dot_via_deq<deq_q2_k_scalar, 3>; q2.dot[3] = dot_via_deq<deq_q2_k_scalar, 4>;
  q3.dot[0] = dot_via_deq<deq_q3_k_scalar, 1>; q3.dot[1] = dot_via_deq<deq_q3_k_scalar, 2>;
  q3.dot[2] = dot_via_deq<deq_q3_k_scalar, 3>; q3.dot[3] = dot_via_deq<deq_q3_k_scalar, 4>;
#endif
}

}  // namespace tq
