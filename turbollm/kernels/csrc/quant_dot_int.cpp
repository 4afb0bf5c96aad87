// The two non-GGML weight formats of kernels/quant.py: int8 per output channel and int4
// group-wise. Row dot products with Q8 activations and bit-exact row dequantization.
//
// int8: W[n] = w[n] * scale[n]  ->  w . x = scale[n] * sum_b dx_b (|w_b| . (qx_b * sign(w_b))).
// int4: W[n, k] = (q - z_g) * s_g for group g = k / group (a multiple of 32), q unsigned 4-bit
//       with the even column in the low nibble, s_g float16, z_g uint8  ->  per 32-block b in group g
//       w_b . x_b = s_g dx_b (q_b . qx_b) - (s_g z_g) s32_b.
#include "quant_common.h"

#include <cmath>

namespace tq {
namespace {

void deq_int8(const WView& w, int64_t n, float* out) {
  const int8_t* row = reinterpret_cast<const int8_t*>(w.row(n));
  const float s = w.scale[n];
#ifdef __AVX2__
  const __m256 vs = _mm256_set1_ps(s), z = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.K / 32; ++b) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
    deq32<Aff::Mul, true>(q, vs, z, out + 32 * b);
  }
#else
  for (int64_t i = 0; i < w.K; ++i) out[i] = (float)row[i] * s;
#endif
}

void deq_int4(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  const int64_t groups = w.K / w.group;
  const uint8_t* s16 = w.scale16 + 2 * n * groups;
  const uint8_t* z8 = w.zero8 + n * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float sg = fp16_to_fp32(s16 + 2 * g), zg = (float)z8[g];
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(sg), vz = _mm256_set1_ps(zg);
    for (int64_t b = 0; b < w.group / 32; ++b) {
      const int64_t k0 = g * w.group + 32 * b;
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
      const __m128i lo = _mm_and_si128(p, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(p, 4), _mm_set1_epi8(0x0F));
      deq16<Aff::SubMul, false>(_mm_unpacklo_epi8(lo, hi), vs, vz, out + k0);
      deq16<Aff::SubMul, false>(_mm_unpackhi_epi8(lo, hi), vs, vz, out + k0 + 16);
    }
#else
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
      const int q = (k & 1) ? (row[k / 2] >> 4) : (row[k / 2] & 0x0F);
      out[k] = ((float)q - zg) * sg;
    }
#endif
  }
}

#ifdef __AVX2__
template <int T>
void dot_int8(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int8_t* xq[T];
  const float* xd[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) {
    xq[t] = a.qrow(m0 + t); xd[t] = a.drow(m0 + t);
  }
  for (int64_t b = 0; b < w.K / 32; ++b) {
    if ((b & 1) == 0) prefetch_ahead(row + 32 * b, 1);
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
    const __m256i aw = _mm256_abs_epi8(wq);
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + 32 * b));
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(aw, _mm256_sign_epi8(x, wq)));
      acc.at(t, (int)(b % Acc<T>::A)) = _mm256_fmadd_ps(p, _mm256_set1_ps(xd[t][b]), acc.at(t, (int)(b % Acc<T>::A)));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = w.scale[n] * acc.sum(t);
}

template <int T>
void dot_int4(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int64_t groups = w.K / w.group, per = w.group / 32;
  const uint8_t* s16 = w.scale16 + 2 * n * groups;
  const uint8_t* z8 = w.zero8 + n * groups;
  const int8_t* xq[T];
  const float *xd[T], *xs[T];
  Acc<T> acc;
  float corr[T][Acc<T>::A] = {};
  for (int t = 0; t < T; ++t) {
    xq[t] = a.qrow(m0 + t); xd[t] = a.drow(m0 + t); xs[t] = a.s32row(m0 + t);
  }
  const __m128i m4 = _mm_set1_epi8(0x0F);
  float d = 0.f, c = 0.f;
  for (int64_t b = 0; b < w.K / 32; ++b) {
    if ((b & 3) == 0) prefetch_ahead(row + 16 * b, 1);
    if (b % per == 0) {
      const int64_t g = b / per;
      d = fp16_to_fp32(s16 + 2 * g);
      c = -(d * (float)z8[g]);
    }
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i lo = _mm_and_si128(p, m4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m4);
    const __m256i q = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    const int j = (int)(b % Acc<T>::A);
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + 32 * b));
      const __m256 pr = _mm256_cvtepi32_ps(dot_u8s8(q, x));
      acc.at(t, j) = _mm256_fmadd_ps(pr, _mm256_set1_ps(d * xd[t][b]), acc.at(t, j));
      corr[t][j] = std::fma(c, xs[t][b], corr[t][j]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float c = 0.f;
    for (int j = 0; j < Acc<T>::A; ++j) c += corr[t][j];
    out[t * ostride] = acc.sum(t) + c;
  }
}
#endif

}  // namespace

void register_intq(TypeKernels* table) {
  TypeKernels& i8 = table[table_index(kInt8)];
  i8.block = 32; i8.bytes = 32; i8.deq = deq_int8;
  TypeKernels& i4 = table[table_index(kInt4)];
  i4.block = 32; i4.bytes = 16; i4.deq = deq_int4;
#ifdef __AVX2__
  i8.dot[0] = dot_int8<1>; i8.dot[1] = dot_int8<2>; i8.dot[2] = dot_int8<3>; i8.dot[3] = dot_int8<4>;
  i4.dot[0] = dot_int4<1>; i4.dot[1] = dot_int4<2>; i4.dot[2] = dot_int4<3>; i4.dot[3] = dot_int4<4>;
#else
  i8.dot[0] = dot_via_deq<deq_int8, 1>; i8.dot[1] = dot_via_deq<deq_int8, 2>;
  i8.dot[2] = dot_via_deq<deq_int8, 3>; i8.dot[3] = dot_via_deq<deq_int8, 4>;
  i4.dot[0] = dot_via_deq<deq_int4, 1>; i4.dot[1] = dot_via_deq<deq_int4, 2>;
  i4.dot[2] = dot_via_deq<deq_int4, 3>; i4.dot[3] = dot_via_deq<deq_int4, 4>;
#endif
}

}  // namespace tq
