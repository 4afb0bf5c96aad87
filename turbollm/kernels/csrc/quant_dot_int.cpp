// The non-GGML weight formats of kernels/quant.py: int8 per output channel, int4 and int3
// group-wise. Row dot products with Q8 activations and bit-exact row dequantization.
//
// int8: W[n] = w[n] * scale[n]  ->  w . x = scale[n] * sum_b dx_b (|w_b| . (qx_b * sign(w_b))).
// int4 / int3: W[n, k] = (q - z_g) * s_g for group g = k / group (a multiple of 32), q unsigned,
//       s_g float16, z_g uint8  ->  per 32-block b in group g
//       w_b . x_b = s_g dx_b (q_b . qx_b) - (s_g z_g) s32_b.
//       The two differ only in how a block of 32 codes is packed (the Nibbles and ThreeBit
//       structs below); the group / scale / zero logic is one template (deq_group, dot_group):
//       int4: 16 bytes per block, the even column in the low nibble;
//       int3: 12 bytes per block (packing.pack_3bit): bytes 0..7 hold the low 2 bits of codes
//       j, j+8, j+16, j+24 at shifts 0, 2, 4, 6 (byte j), bytes 8..11 a little-endian uint32
//       whose bit i is bit 2 of code i.
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

// Block packings of the group-wise types: kBytes per 32 codes; code(blk, i) is code i of the
// block at blk (portable path), decode(blk) the 32 codes as bytes in column order (AVX2).
struct Nibbles {  // int4
  static constexpr int kBytes = 16;
  static inline int code(const uint8_t* blk, int i) { return (i & 1) ? (blk[i / 2] >> 4) : (blk[i / 2] & 0x0F); }
#ifdef __AVX2__
  static inline __m256i decode(const uint8_t* blk) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    const __m128i lo = _mm_and_si128(p, m4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m4);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  }
#endif
};

struct ThreeBit {  // int3
  static constexpr int kBytes = 12;
  static inline int code(const uint8_t* blk, int i) {
    return ((blk[i & 7] >> (2 * (i >> 3))) & 3) | (((blk[8 + (i >> 3)] >> (i & 7)) & 1) << 2);
  }
#ifdef __AVX2__
  static inline __m256i decode(const uint8_t* blk) {
    int64_t low;
    std::memcpy(&low, blk, 8);
    // 64-bit lane r holds the low bytes shifted right by 2r: its byte j is code 8r + j in bits 0-1
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(low), _mm256_setr_epi64x(0, 2, 4, 6)),
                                        _mm256_set1_epi8(0x03));
    return _mm256_or_si256(lo, _mm256_and_si256(bits_to_bytes(blk + 8), _mm256_set1_epi8(0x04)));
  }
#endif
};

template <class C>
void deq_group(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  const int64_t groups = w.K / w.group, per = w.group / 32;
  const uint8_t* s16 = w.scale16 + 2 * n * groups;
  const uint8_t* z8 = w.zero8 + n * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float sg = fp16_to_fp32(s16 + 2 * g), zg = (float)z8[g];
#ifdef __AVX2__
    const __m256 vs = _mm256_set1_ps(sg), vz = _mm256_set1_ps(zg);
#endif
    for (int64_t b = g * per; b < (g + 1) * per; ++b) {
      const uint8_t* blk = row + C::kBytes * b;
#ifdef __AVX2__
      deq32<Aff::SubMul, false>(C::decode(blk), vs, vz, out + 32 * b);
#else
      for (int i = 0; i < 32; ++i) out[32 * b + i] = ((float)C::code(blk, i) - zg) * sg;
#endif
    }
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

template <class C, int T>
void dot_group(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
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
  float d = 0.f, c = 0.f;
  for (int64_t b = 0; b < w.K / 32; ++b) {
    if ((b & 3) == 0) prefetch_ahead(row + C::kBytes * b, 1);  // 4 blocks: at most 64 bytes
    if (b % per == 0) {
      const int64_t g = b / per;
      d = fp16_to_fp32(s16 + 2 * g);
      c = -(d * (float)z8[g]);
    }
    const __m256i q = C::decode(row + C::kBytes * b);
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

template <class C>
void register_group(TypeKernels& k) {
  k.block = 32; k.bytes = C::kBytes; k.deq = deq_group<C>;
#ifdef __AVX2__
  k.dot[0] = dot_group<C, 1>; k.dot[1] = dot_group<C, 2>; k.dot[2] = dot_group<C, 3>; k.dot[3] = dot_group<C, 4>;
#else
  k.dot[0] = dot_via_deq<deq_group<C>, 1>; k.dot[1] = dot_via_deq<deq_group<C>, 2>;
  k.dot[2] = dot_via_deq<deq_group<C>, 3>; k.dot[3] = dot_via_deq<deq_group<C>, 4>;
#endif
}

}  // namespace

void register_intq(TypeKernels* table) {
  TypeKernels& i8 = table[table_index(kInt8)];
  i8.block = 32; i8.bytes = 32; i8.deq = deq_int8;
#ifdef __AVX2__
  i8.dot[0] = dot_int8<1>; i8.dot[1] = dot_int8<2>; i8.dot[2] = dot_int8<3>; i8.dot[3] = dot_int8<4>;
#else
  i8.dot[0] = dot_via_deq<deq_int8, 1>; i8.dot[1] = dot_via_deq<deq_int8, 2>;
  i8.dot[2] = dot_via_deq<deq_int8, 3>; i8.dot[3] = dot_via_deq<deq_int8, 4>;
#endif
  register_group<Nibbles>(table[table_index(kInt4)]);
  register_group<ThreeBit>(table[table_index(kInt3)]);
}

}  // namespace tq
