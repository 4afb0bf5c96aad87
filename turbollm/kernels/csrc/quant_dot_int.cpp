// The non-GGML weight formats of kernels/quant.py: int8 per output channel, int4 and int3
// group-wise. Row dot products with int8 (q8, q8x2) or 16-bit (q16) activations and bit-exact row
// dequantization.
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
//       int4's dot kernels take the activations of each block as its even columns, then its odd
//       ones (act_even_odd), so a block's low nibbles meet the first 16 and its high nibbles the
//       last 16 without the byte interleave the column order would need.
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
// block at blk (portable path), decode(blk) the 32 codes as bytes in column order (AVX2
// dequantization). The dot kernels read the codes in the order of the activations
// (kEvenOdd: TypeKernels::act_even_odd): codes8 as 32 bytes, codes16 as two int16 vectors of 16.
struct Nibbles {  // int4
  static constexpr int kBytes = 16;
  static constexpr bool kEvenOdd = true;  // byte i holds columns 2i (low nibble) and 2i + 1
  static inline int code(const uint8_t* blk, int i) { return (i & 1) ? (blk[i / 2] >> 4) : (blk[i / 2] & 0x0F); }
#ifdef __AVX2__
  static inline void nibbles(const uint8_t* blk, __m128i& lo, __m128i& hi) {  // even columns, odd columns
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    lo = _mm_and_si128(p, m4);
    hi = _mm_and_si128(_mm_srli_epi16(p, 4), m4);
  }
  static inline __m256i decode(const uint8_t* blk) {
    __m128i lo, hi;
    nibbles(blk, lo, hi);
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  }
  static inline __m256i codes8(const uint8_t* blk) {  // even columns, then odd
    __m128i lo, hi;
    nibbles(blk, lo, hi);
    return _mm256_set_m128i(hi, lo);
  }
  static inline void codes16(const uint8_t* blk, __m256i& w0, __m256i& w1) {  // even columns, odd columns
    const __m256i p = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    w0 = _mm256_and_si256(p, _mm256_set1_epi16(0x0F));
    w1 = _mm256_srli_epi16(p, 4);
  }
#endif
};

struct ThreeBit {  // int3
  static constexpr int kBytes = 12;
  static constexpr bool kEvenOdd = false;
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
  static inline __m256i codes8(const uint8_t* blk) { return decode(blk); }
  static inline void codes16(const uint8_t* blk, __m256i& w0, __m256i& w1) { widen16<false>(decode(blk), w0, w1); }
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
static inline __m256i load32(const int8_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }

// X16: 16-bit activations (a.q16, widen16 / dot_x16 of quant_common.h); otherwise int8 ones
// (u8 x s8 products; int8's signed weights by the sign trick |w| . (x * sign(w))).
template <int T, bool X16>
void dot_int8(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int8_t* xq[T];
  const int16_t* xq16[T];
  const float* xd[T];
  Acc<T> acc;
  for (int t = 0; t < T; ++t) {
    if constexpr (X16) xq16[t] = a.q16row(m0 + t); else xq[t] = a.qrow(m0 + t);
    xd[t] = a.drow(m0 + t);
  }
  for (int64_t b = 0; b < w.K / 32; ++b) {
    if ((b & 1) == 0) prefetch_ahead(row + 32 * b, 1);
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
    __m256i w0, w1, aw;
    if constexpr (X16) widen16<true>(wq, w0, w1); else aw = _mm256_abs_epi8(wq);
    for (int t = 0; t < T; ++t) {
      const __m256i s = X16 ? dot_x16(w0, w1, xq16[t] + 32 * b)
                            : dot_u8s8(aw, _mm256_sign_epi8(load32(xq[t] + 32 * b), wq));
      const __m256 p = _mm256_cvtepi32_ps(s);
      acc.at(t, (int)(b % Acc<T>::A)) = _mm256_fmadd_ps(p, _mm256_broadcast_ss(xd[t] + b), acc.at(t, (int)(b % Acc<T>::A)));
    }
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = w.scale[n] * acc.sum(t);
}

// Blocks are taken 8 at a time: their group scales d and offsets c = -d z spread to one float per
// block, d * dx and c * s32 as 8-wide vectors (the offset term accumulated in a vector); then
// one block at a time for the remainder (K / 32 not a multiple of 8). The spread is a permute of
// the row's packed fp16 scales and uint8 zeros when a group spans 1, 2 or 4 blocks (group 32, 64,
// 128), a broadcast when it spans a multiple of 8, and block by block otherwise (e.g. group 96).
template <int Per>
static inline void spread_scales(const uint8_t* s16, const uint8_t* z8, int64_t g0, __m256& d8, __m256& c8) {
  __m128i sh, zb;
  if constexpr (Per == 1) {
    sh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + 2 * g0));
    zb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z8 + g0));
  } else if constexpr (Per == 2) {
    sh = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s16 + 2 * g0));
    zb = _mm_cvtsi32_si128((int)load_u32(z8 + g0));
  } else {
    static_assert(Per == 4, "groups of 1, 2 or 4 blocks");
    sh = _mm_cvtsi32_si128((int)load_u32(s16 + 2 * g0));
    uint16_t z2;
    std::memcpy(&z2, z8 + g0, 2);
    zb = _mm_cvtsi32_si128(z2);
  }
  const __m256i idx = Per == 1 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                    : Per == 2 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                               : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  d8 = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(sh), idx);
  const __m256 z = _mm256_permutevar8x32_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(zb)), idx);
  c8 = _mm256_xor_ps(_mm256_mul_ps(d8, z), _mm256_set1_ps(-0.0f));  // -(d z), as the scalar path
}

template <class C, int T, bool X16>
void dot_group(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int64_t nb = w.K / 32, groups = w.K / w.group, per = w.group / 32;
  const uint8_t* s16 = w.scale16 + 2 * n * groups;
  const uint8_t* z8 = w.zero8 + n * groups;
  const int8_t* xq[T];
  const int16_t* xq16[T];
  const float *xd[T], *xs[T];
  Acc<T> acc;
  __m256 corr[T];
  float corr1[T] = {};
  alignas(32) float ddx[T][8];
  alignas(32) float dv[8], cv[8];
  for (int t = 0; t < T; ++t) {
    if constexpr (X16) xq16[t] = a.q16row(m0 + t); else xq[t] = a.qrow(m0 + t);
    xd[t] = a.drow(m0 + t); xs[t] = a.s32row(m0 + t);
    corr[t] = _mm256_setzero_ps();
  }
  auto block = [&](int64_t b, int j) {
    const uint8_t* blk = row + C::kBytes * b;
    __m256i q, w0, w1;
    if constexpr (X16) C::codes16(blk, w0, w1); else q = C::codes8(blk);
    for (int t = 0; t < T; ++t) {
      const __m256i s = X16 ? dot_x16(w0, w1, xq16[t] + 32 * b) : dot_u8s8(q, load32(xq[t] + 32 * b));
      const __m256 p = _mm256_cvtepi32_ps(s);
      __m256& av = acc.at(t, j);
      av = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&ddx[t][j]), av);
    }
  };
  // block b's group g and its place r in it, advanced block by block (no divisions)
  int64_t g = 0, r = 0;
  float d = fp16_to_fp32(s16), c = -(d * (float)z8[0]);
  auto next = [&]() {
    if (++r == per && ++g < groups) {
      r = 0;
      d = fp16_to_fp32(s16 + 2 * g), c = -(d * (float)z8[g]);
    }
  };
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    prefetch_ahead(row + C::kBytes * b, (8 * C::kBytes + 63) / 64);
    __m256 d8, c8;
    switch (per) {
      case 1: spread_scales<1>(s16, z8, b, d8, c8); break;
      case 2: spread_scales<2>(s16, z8, b >> 1, d8, c8); break;
      case 4: spread_scales<4>(s16, z8, b >> 2, d8, c8); break;
      default:
        if (per % 8 == 0) {
          const int64_t gb = b / per;
          const float db = fp16_to_fp32(s16 + 2 * gb);
          d8 = _mm256_set1_ps(db), c8 = _mm256_set1_ps(-(db * (float)z8[gb]));
        } else {
          for (int i = 0; i < 8; ++i, next()) { dv[i] = d; cv[i] = c; }
          d8 = _mm256_load_ps(dv), c8 = _mm256_load_ps(cv);
        }
    }
    for (int t = 0; t < T; ++t) {
      _mm256_store_ps(ddx[t], _mm256_mul_ps(d8, _mm256_loadu_ps(xd[t] + b)));
      corr[t] = _mm256_fmadd_ps(c8, _mm256_loadu_ps(xs[t] + b), corr[t]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) block(b + j, j);
  }
  g = b / per, r = b % per;  // the remainder's first block (the vector spreads do not advance g, r)
  if (g < groups) d = fp16_to_fp32(s16 + 2 * g), c = -(d * (float)z8[g]);
  for (; b < nb; ++b, next()) {  // remainder: scalar scales
    for (int t = 0; t < T; ++t) {
      ddx[t][0] = d * xd[t][b];
      corr1[t] = std::fma(c, xs[t][b], corr1[t]);
    }
    block(b, 0);
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t) + (hsum(corr[t]) + corr1[t]);
}
#endif

template <class C>
void register_group(TypeKernels& k) {
  k.block = 32; k.bytes = C::kBytes; k.deq = deq_group<C>;
#ifdef __AVX2__
  k.act_even_odd = C::kEvenOdd;
  k.dot[0] = dot_group<C, 1, false>; k.dot[1] = dot_group<C, 2, false>;
  k.dot[2] = dot_group<C, 3, false>; k.dot[3] = dot_group<C, 4, false>;
  k.dot16[0] = dot_group<C, 1, true>; k.dot16[1] = dot_group<C, 2, true>;
  k.dot16[2] = dot_group<C, 3, true>; k.dot16[3] = dot_group<C, 4, true>;
  k.dot[4] = dot_group<C, 5, false>; k.dot[5] = dot_group<C, 6, false>;
  k.dot[6] = dot_group<C, 7, false>; k.dot[7] = dot_group<C, 8, false>;
  k.dot16[4] = dot_group<C, 5, true>; k.dot16[5] = dot_group<C, 6, true>;
  k.dot16[6] = dot_group<C, 7, true>; k.dot16[7] = dot_group<C, 8, true>;
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
  i8.dot[0] = dot_int8<1, false>; i8.dot[1] = dot_int8<2, false>; i8.dot[2] = dot_int8<3, false>;
  i8.dot[3] = dot_int8<4, false>;
  i8.dot16[0] = dot_int8<1, true>; i8.dot16[1] = dot_int8<2, true>; i8.dot16[2] = dot_int8<3, true>;
  i8.dot16[3] = dot_int8<4, true>;
  i8.dot[4] = dot_int8<5, false>; i8.dot[5] = dot_int8<6, false>; i8.dot[6] = dot_int8<7, false>;
  i8.dot[7] = dot_int8<8, false>;
  i8.dot16[4] = dot_int8<5, true>; i8.dot16[5] = dot_int8<6, true>; i8.dot16[6] = dot_int8<7, true>;
  i8.dot16[7] = dot_int8<8, true>;
#else
  i8.dot[0] = dot_via_deq<deq_int8, 1>; i8.dot[1] = dot_via_deq<deq_int8, 2>;
  i8.dot[2] = dot_via_deq<deq_int8, 3>; i8.dot[3] = dot_via_deq<deq_int8, 4>;
#endif
  register_group<Nibbles>(table[table_index(kInt4)]);
  register_group<ThreeBit>(table[table_index(kInt3)]);
}

}  // namespace tq
