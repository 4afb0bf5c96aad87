// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32-weight blocks): row dot products with Q8 activations and
// bit-exact row dequantization. Block layouts: formats/ggml_types/legacy.py.
//
// A block is w = d * q + c with unsigned q (4 or 5 bits) and c = m (the _1 types) or
// c = -8 d / -16 d (the _0 types), so  w . x = d * dx * (q . qx) + c * s32  where s32 is the
// activation block's d * sum(qx). The integer dot is maddubs (u8 x s8) + madd; Q8_0 (signed
// weights) uses the sign trick: |w| . (qx * sign(w)).
#include "quant_common.h"

#include <cmath>

namespace tq {
namespace {

// ---- block accessors: scale d, offset c, and the 32 unsigned quants --------------------------

struct Q4_0B {
  static constexpr int kBytes = 18;
  static inline float d(const uint8_t* b) { return fp16_to_fp32(b); }
  static inline float c(const uint8_t*, float d) { return -8.f * d; }
  static inline void scalar(const uint8_t* b, uint8_t q[32]) {
    for (int i = 0; i < 16; ++i) { q[i] = b[2 + i] & 0x0F; q[i + 16] = b[2 + i] >> 4; }
  }
#ifdef __AVX2__
  static inline __m256i quants(const uint8_t* b) { return nibbles_lo_hi(b + 2); }
#endif
};

struct Q4_1B {
  static constexpr int kBytes = 20;
  static inline float d(const uint8_t* b) { return fp16_to_fp32(b); }
  static inline float c(const uint8_t* b, float) { return fp16_to_fp32(b + 2); }
  static inline void scalar(const uint8_t* b, uint8_t q[32]) {
    for (int i = 0; i < 16; ++i) { q[i] = b[4 + i] & 0x0F; q[i + 16] = b[4 + i] >> 4; }
  }
#ifdef __AVX2__
  static inline __m256i quants(const uint8_t* b) { return nibbles_lo_hi(b + 4); }
#endif
};

template <int QH, int QS>  // byte offsets of the 32 high bits and of the nibbles
struct Q5Bits {
  static inline void scalar(const uint8_t* b, uint8_t q[32]) {
    const uint32_t qh = load_u32(b + QH);
    for (int i = 0; i < 16; ++i) {
      q[i] = (b[QS + i] & 0x0F) | (((qh >> i) & 1) << 4);
      q[i + 16] = (b[QS + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
  }
#ifdef __AVX2__
  static inline __m256i quants(const uint8_t* b) {
    return _mm256_or_si256(nibbles_lo_hi(b + QS), bits_to_0x10(b + QH));
  }
#endif
};

struct Q5_0B : Q5Bits<2, 6> {
  static constexpr int kBytes = 22;
  static inline float d(const uint8_t* b) { return fp16_to_fp32(b); }
  static inline float c(const uint8_t*, float d) { return -16.f * d; }
};

struct Q5_1B : Q5Bits<4, 8> {
  static constexpr int kBytes = 24;
  static inline float d(const uint8_t* b) { return fp16_to_fp32(b); }
  static inline float c(const uint8_t* b, float) { return fp16_to_fp32(b + 2); }
};

// ---- dequantization (the PyTorch decoders' fp32 operations, in the same order) ---------------

// Q4_0 / Q5_0: float(q - off) * d.  Q4_1 / Q5_1: float(q) * d + m.
template <class B, int OFF>
void deq_legacy(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  for (int64_t b = 0; b < w.K / 32; ++b, row += B::kBytes, out += 32) {
    const float d = B::d(row);
#ifdef __AVX2__
    const __m256i q = B::quants(row);
    if (OFF) {
      deq32<Aff::Mul, true>(_mm256_sub_epi8(q, _mm256_set1_epi8(OFF)), _mm256_set1_ps(d), _mm256_setzero_ps(), out);
    } else {
      deq32<Aff::MulAdd, false>(q, _mm256_set1_ps(d), _mm256_set1_ps(B::c(row, d)), out);
    }
#else
    uint8_t q[32];
    B::scalar(row, q);
    if (OFF) {
      for (int i = 0; i < 32; ++i) out[i] = (float)((int)q[i] - OFF) * d;
    } else {
      const float m = B::c(row, d);
      for (int i = 0; i < 32; ++i) out[i] = (float)q[i] * d + m;
    }
#endif
  }
}

void deq_q8_0(const WView& w, int64_t n, float* out) {
  const uint8_t* row = w.row(n);
  for (int64_t b = 0; b < w.K / 32; ++b, row += 34, out += 32) {
    const float d = fp16_to_fp32(row);
#ifdef __AVX2__
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2));
    deq32<Aff::Mul, true>(q, _mm256_set1_ps(d), _mm256_setzero_ps(), out);
#else
    const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
    for (int i = 0; i < 32; ++i) out[i] = (float)q[i] * d;
#endif
  }
}

#ifdef __AVX2__
// ---- dot products --------------------------------------------------------------------------

struct Q8_0B {
  static constexpr int kBytes = 34;
  static inline __m256i quants(const uint8_t* b) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)); }
};

// Offset kind of a block type: none (Q8_0), a multiple of d (Q4_0: -8, Q5_0: -16) or the fp16 m.
enum class Off { None, ScaleMul, Min };

// Eight consecutive blocks' fp16 fields at p, p + stride, ...: gathered in integer registers
// (idle ALU pipes) and widened with one vcvtph2ps.
static inline uint64_t load_u16_gpr(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  uint64_t r = v;
  asm("" : "+r"(r));  // keep it in a general register: no vectorized gather of the eight loads
  return r;
}

static inline __m256 gather_fp16x8(const uint8_t* p, int64_t stride) {
  uint64_t lo = 0, hi = 0;
  for (int i = 0; i < 4; ++i) {
    lo |= load_u16_gpr(p + i * stride) << (16 * i);
    hi |= load_u16_gpr(p + (i + 4) * stride) << (16 * i);
  }
  return _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
}

// Blocks are taken 8 at a time (their scales handled as 8-wide vectors: d * dx, and the offset
// term c * s32 accumulated in a vector), then one at a time for the remainder.
// X16: 16-bit activations (a.q16): the 32 weights widened to int16 (widen16, dot_x16).
template <class B, bool Signed, Off O, int OFF, int T, bool X16 = false>
void dot_legacy(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  const uint8_t* row = w.row(n);
  const int64_t nb = w.K / 32;
  const int8_t* xq[T];
  const int16_t* xq16[T];
  const float *xd[T], *xs[T];
  Acc<T> acc;
  __m256 corr[T];
  float corr1[T] = {};
  alignas(32) float ddx[T][8];
  for (int t = 0; t < T; ++t) {
    if constexpr (X16) xq16[t] = a.q16row(m0 + t); else xq[t] = a.qrow(m0 + t);
    xd[t] = a.drow(m0 + t); xs[t] = a.s32row(m0 + t);
    corr[t] = _mm256_setzero_ps();
  }
  // one block: j (compile-time after unrolling) picks the accumulation chain and the scale slot
  auto block = [&](const uint8_t* blk, int64_t b, const float* const* scale, int j) {
    const __m256i q = B::quants(blk);
    if constexpr (X16) {
      __m256i w0, w1;
      widen16<Signed>(q, w0, w1);
      for (int t = 0; t < T; ++t) {
        const __m256i s = dot_x16(w0, w1, xq16[t] + b * 32);
        __m256& av = acc.at(t, j);
        av = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(&scale[t][j]), av);
      }
      return;
    }
    const __m256i u = Signed ? _mm256_abs_epi8(q) : q;
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + b * 32));
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(u, Signed ? _mm256_sign_epi8(x, q) : x));
      __m256& av = acc.at(t, j);
      av = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&scale[t][j]), av);
    }
  };
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const uint8_t* g = row + b * B::kBytes;
    prefetch_ahead(g, (8 * B::kBytes + 63) / 64);
    const __m256 d8 = gather_fp16x8(g, B::kBytes);
    __m256 c8 = _mm256_setzero_ps();  // the 8 blocks' offsets c
    if constexpr (O == Off::Min) c8 = gather_fp16x8(g + 2, B::kBytes);
    if constexpr (O == Off::ScaleMul) c8 = _mm256_mul_ps(d8, _mm256_set1_ps((float)OFF));
    for (int t = 0; t < T; ++t) {
      _mm256_store_ps(ddx[t], _mm256_mul_ps(d8, _mm256_loadu_ps(xd[t] + b)));
      if constexpr (O != Off::None) corr[t] = _mm256_fmadd_ps(c8, _mm256_loadu_ps(xs[t] + b), corr[t]);
    }
    float* rows[T];
    for (int t = 0; t < T; ++t) rows[t] = ddx[t];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) block(g + j * B::kBytes, b + j, rows, j);
  }
  for (; b < nb; ++b) {  // remainder: scalar scales
    const uint8_t* blk = row + b * B::kBytes;
    const float d = fp16_to_fp32(blk);
    const float c = O == Off::Min ? fp16_to_fp32(blk + 2) : (float)OFF * d;
    for (int t = 0; t < T; ++t) {
      ddx[t][0] = d * xd[t][b];
      if constexpr (O != Off::None) corr1[t] = std::fma(c, xs[t][b], corr1[t]);
    }
    float* rows[T];
    for (int t = 0; t < T; ++t) rows[t] = ddx[t];
    block(blk, b, rows, 0);
  }
  for (int t = 0; t < T; ++t) out[t * ostride] = acc.sum(t) + (hsum(corr[t]) + corr1[t]);
}

#define TQ_FILL_LEGACY(k, ...)                                                                          \
  do {                                                                                                  \
    (k).dot[0] = dot_legacy<__VA_ARGS__, 1>; (k).dot[1] = dot_legacy<__VA_ARGS__, 2>;                   \
    (k).dot[2] = dot_legacy<__VA_ARGS__, 3>; (k).dot[3] = dot_legacy<__VA_ARGS__, 4>;                   \
    (k).dot16[0] = dot_legacy<__VA_ARGS__, 1, true>; (k).dot16[1] = dot_legacy<__VA_ARGS__, 2, true>;   \
    (k).dot16[2] = dot_legacy<__VA_ARGS__, 3, true>; (k).dot16[3] = dot_legacy<__VA_ARGS__, 4, true>;   \
    (k).dot[4] = dot_legacy<__VA_ARGS__, 5>; (k).dot[5] = dot_legacy<__VA_ARGS__, 6>;                   \
    (k).dot[6] = dot_legacy<__VA_ARGS__, 7>; (k).dot[7] = dot_legacy<__VA_ARGS__, 8>;                   \
    (k).dot16[4] = dot_legacy<__VA_ARGS__, 5, true>; (k).dot16[5] = dot_legacy<__VA_ARGS__, 6, true>;   \
    (k).dot16[6] = dot_legacy<__VA_ARGS__, 7, true>; (k).dot16[7] = dot_legacy<__VA_ARGS__, 8, true>;   \
  } while (0)

void fill_dots(TypeKernels* table) {
  TQ_FILL_LEGACY(table[table_index(kQ4_0)], Q4_0B, false, Off::ScaleMul, -8);
  TQ_FILL_LEGACY(table[table_index(kQ4_1)], Q4_1B, false, Off::Min, 0);
  TQ_FILL_LEGACY(table[table_index(kQ5_0)], Q5_0B, false, Off::ScaleMul, -16);
  TQ_FILL_LEGACY(table[table_index(kQ5_1)], Q5_1B, false, Off::Min, 0);
  TQ_FILL_LEGACY(table[table_index(kQ8_0)], Q8_0B, true, Off::None, 0);
}
#else
void fill_dots(TypeKernels*) {}
#endif

template <DeqFn DEQ>
void fill_fallback(TypeKernels& k) {
  if (k.dot[0]) return;
  k.dot[0] = dot_via_deq<DEQ, 1>; k.dot[1] = dot_via_deq<DEQ, 2>;
  k.dot[2] = dot_via_deq<DEQ, 3>; k.dot[3] = dot_via_deq<DEQ, 4>;
}

}  // namespace

void register_legacy(TypeKernels* table) {
  auto set = [&](int qtype, int bytes, DeqFn deq) {
    TypeKernels& k = table[table_index(qtype)];
    k.block = 32;
    k.bytes = bytes;
    k.deq = deq;
  };
  set(kQ4_0, 18, deq_legacy<Q4_0B, 8>);
  set(kQ4_1, 20, deq_legacy<Q4_1B, 0>);
  set(kQ5_0, 22, deq_legacy<Q5_0B, 16>);
  set(kQ5_1, 24, deq_legacy<Q5_1B, 0>);
  set(kQ8_0, 34, deq_q8_0);
  fill_dots(table);
  fill_fallback<deq_legacy<Q4_0B, 8>>(table[table_index(kQ4_0)]);
  fill_fallback<deq_legacy<Q4_1B, 0>>(table[table_index(kQ4_1)]);
  fill_fallback<deq_legacy<Q5_0B, 16>>(table[table_index(kQ5_0)]);
  fill_fallback<deq_legacy<Q5_1B, 0>>(table[table_index(kQ5_1)]);
  fill_fallback<deq_q8_0>(table[table_index(kQ8_0)]);
}

}  // namespace tq
