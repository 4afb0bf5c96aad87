// The avx2_tiles kernel form: the repacked layouts of repacked.h (the avx512_vnni form's bytes) multiplied
// with AVX2 instructions, tiles of MR activation rows (1..8) by one group of 16 weight rows, for any
// number of rows, so that an AVX2-only CPU (AMD Zen 3) also gets a batched integer GEMM and row
// invariance at every batch size.
//
// A 64-byte quad of the layout (16 rows x 4 inputs) is two ymm halves: rows 0-7 and rows 8-15. Per
// 32-block, the codes of both halves are decoded once into an L1 scratch of unsigned bytes (Q8_0: |q|,
// with q kept beside them for the sign trick below), then every activation row runs, per sub-block and half,
//   p    = sum over a run of quads of maddubs(codes, 4 inputs broadcast)        (int16, exact: see kRun)
//   isum = init + sum of madd(p, 1)                                                (int32, exact)
//   acc  = fma(float(isum), w_scale * d_x, acc)            (+/- w_min * s32_x for the types with a min)
// maddubs adds two u8 x s8 products in int16 with saturation, so each type sums only as many quads in
// int16 as cannot reach 32767 (kRun: codes < 16: 8 quads, < 32: 4, < 64: 2). Q8_0's codes (stored + 128)
// would: they are taken as signed q, |q| against sign(x, q) (|q| <= 128, |x| <= 127), one quad per run and
// no offset. The integer sums are exact and the float steps are those of qmm_units.h's add_block /
// add_min, lane for lane: a row's result is the same bits as the avx512_vnni form's, and does not depend
// on the rows beside it.
//
// Everything is AVX2 + FMA + F16C, the module's own base target (x86-64-v3): registered wherever the
// module runs (quant_repack.cpp).
#include <cstdint>
#include <immintrin.h>

#include "quant_common.h"
#include "repacked.h"

namespace tq {
namespace vavx2 {
namespace {

inline __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Quads 0..3 (low nibbles) and 4..7 (high nibbles) of half h of a 256-byte nib field.
inline void nibbles(const uint8_t* nib, int h, __m256i w[8]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = ld(nib + 64 * j + 32 * h);
    w[j] = _mm256_and_si256(v, m4);
    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
}

// + 16 where an hmask field's bit is set (bit 4r + i of mask j: byte 4r + i of quad j), half h.
inline void fifth_bits(const uint8_t* hm, int h, __m256i w[8]) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), c16 = _mm256_set1_epi8(16);
  for (int j = 0; j < 8; ++j) {
    const __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(hm + 8 * j + 4 * h)), spread);
    w[j] = _mm256_add_epi8(w[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(m, bit), bit), c16));
  }
}

// ---- unit descriptors: a half of a 32-block's codes into 8 registers, weight scales and mins as halves of 8 lanes

// Q4_0 (OFF 8), Q4_1 (MIN), Q5_0 (Q5, OFF 16), Q5_1 (Q5, MIN), Q8_0 (Q8: signed codes, no offset).
template <int OFF, bool MIN, bool Q5, bool Q8>
struct Legacy {
  static constexpr int kUnit = 32, kSub = 32, kOff = Q8 ? 0 : OFF, kRun = Q8 ? 1 : (Q5 ? 4 : 8);
  static constexpr bool kMin = MIN, kMinNeg = false, kSigned = Q8;
  static constexpr int kBytes = kGroupRows * (Q8 ? 34 : 18 + (MIN ? 2 : 0) + (Q5 ? 4 : 0));
  static constexpr int kHm = 32 + (MIN ? 32 : 0), kCodes = kHm + (Q5 ? 64 : 0);
  const uint8_t* u;
  explicit Legacy(const uint8_t* p) : u(p) {}
  // half h of the 32-block's quads into w (Q8_0: |q| into w, q into sgn[j])
  inline void codes(int, int h, __m256i w[8], __m256i* sgn) const {
    if constexpr (Q8) {
      const __m256i flip = _mm256_set1_epi8((char)0x80);
      for (int j = 0; j < 8; ++j) {
        const __m256i q = _mm256_xor_si256(ld(u + kCodes + 64 * j + 32 * h), flip);
        _mm256_store_si256(sgn + j, q);
        w[j] = _mm256_abs_epi8(q);
      }
    } else {
      (void)sgn;
      nibbles(u + kCodes, h, w);
      if constexpr (Q5) fifth_bits(u + kHm, h, w);
    }
  }
  inline __m256 scale(int, int, int h) const { return f16x8(u + 16 * h); }
  inline __m256 minv(int, int h) const { return f16x8(u + 32 + 16 * h); }
};

// Q4_K / Q5_K: per 32-block bb, scale d sc_bb and min dmin m_bb, formed for the unit's 8 blocks at once.
template <bool Q5>
struct K45 {
  static constexpr int kUnit = 256, kSub = 32, kOff = 0, kRun = Q5 ? 4 : 8;
  static constexpr bool kMin = true, kMinNeg = true, kSigned = false;
  static constexpr int kBytes = kGroupRows * (Q5 ? 176 : 144);
  static constexpr int kHm = 256, kNib = Q5 ? 256 + 512 : 256;
  const uint8_t* u;
  alignas(32) float sc[8][16], mn[8][16];  // block bb's scales / mins of the 16 rows
  explicit K45(const uint8_t* p) : u(p) {
    const __m256i m6 = _mm256_set1_epi32(0x3F3F3F3F), m4 = _mm256_set1_epi32(0x0F0F0F0F),
                  m30 = _mm256_set1_epi32(0x30303030), ff = _mm256_set1_epi32(0xFF);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = f16x8(p + 16 * h), dmin = f16x8(p + 32 + 16 * h);
      const __m256i a = ld(p + 64 + 32 * h), b = ld(p + 128 + 32 * h), c = ld(p + 192 + 32 * h);
      const __m256i s[2] = {_mm256_and_si256(a, m6),
                            _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_srli_epi32(a, 2), m30))};
      const __m256i m[2] = {_mm256_and_si256(b, m6),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(c, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi32(b, 2), m30))};
      for (int bb = 0; bb < 8; ++bb) {
        const int sh = 8 * (bb % 4);
        const __m256i sb = _mm256_and_si256(_mm256_srli_epi32(s[bb / 4], sh), ff),
                      mb = _mm256_and_si256(_mm256_srli_epi32(m[bb / 4], sh), ff);
        _mm256_store_ps(sc[bb] + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sb)));
        _mm256_store_ps(mn[bb] + 8 * h, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mb)));
      }
    }
  }
  inline void codes(int bb, int h, __m256i w[8], __m256i*) const {
    nibbles(u + kNib + 256 * bb, h, w);
    if constexpr (Q5) fifth_bits(u + kHm + 64 * bb, h, w);
  }
  inline __m256 scale(int bb, int, int h) const { return _mm256_load_ps(sc[bb] + 8 * h); }
  inline __m256 minv(int bb, int h) const { return _mm256_load_ps(mn[bb] + 8 * h); }
};

// Q6_K: 16-input sub-blocks with int8 scales; codes 0..63, offset 32.
struct Q6K {
  static constexpr int kUnit = 256, kSub = 16, kOff = 32, kRun = 2;
  static constexpr bool kMin = false, kMinNeg = false, kSigned = false;
  static constexpr int kBytes = kGroupRows * 210;
  const uint8_t* u;
  __m256 d[2];
  explicit Q6K(const uint8_t* p) : u(p), d{f16x8(p), f16x8(p + 16)} {}
  inline void codes(int bb, int h, __m256i w[8], __m256i*) const {
    const uint8_t* blk = u + 288 + 384 * bb;
    nibbles(blk, h, w);
    const __m256i c30 = _mm256_set1_epi8(0x30);
    for (int t = 0; t < 2; ++t) {
      const __m256i v = ld(blk + 256 + 64 * t + 32 * h);
      const __m256i hs[4] = {_mm256_slli_epi16(v, 4), _mm256_slli_epi16(v, 2), v, _mm256_srli_epi16(v, 2)};
      for (int jj = 0; jj < 4; ++jj) w[4 * t + jj] = _mm256_or_si256(w[4 * t + jj], _mm256_and_si256(hs[jj], c30));
    }
  }
  inline __m256 scale(int bb, int s, int h) const {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 32 + 16 * (2 * bb + s) + 8 * h));
    return _mm256_mul_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
  }
  inline __m256 minv(int, int) const { return _mm256_setzero_ps(); }
};

// ---- the tile kernel ---------------------------------------------------------------------------

template <class D, int MR>
void tile(const uint8_t* grp, int64_t K, const QAct& a, int64_t m0, float* out, int64_t ldo) {
  constexpr int kSubs = 32 / D::kSub, kQuads = D::kSub / 4;
  static_assert(kQuads % D::kRun == 0, "a sub-block's quads come in whole int16 runs");
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  const int8_t* xq[MR];
  const float *xd[MR], *xs[MR];
  const int32_t* xi[MR];
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    xq[m] = a.q + (m0 + m) * K;
    xd[m] = a.d + (m0 + m) * nb;
    xs[m] = D::kMin ? a.s32 + (m0 + m) * nb : nullptr;
    xi[m] = D::kOff ? a.init + (m0 + m) * nb * kSubs : nullptr;
  }
  alignas(32) __m256i sgn[2][8];  // Q8_0: the signed codes of each half
  alignas(32) __m256i wc[2][8];   // the codes of both halves: every activation row meets them with one broadcast
  for (int64_t un = 0; un < K / D::kUnit; ++un) {
    const uint8_t* up = grp + un * D::kBytes;
    // every line, 4 KB ahead: one line in four (the avx512_vnni form's choice) read 8-12 GB/s of this Zen 3's
    // 22 at one row from memory, every line 15-19 (tile kernel alone, 2 threads, 2026-12-07)
    for (int l = 0; l < D::kBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(up + 4096 + l), _MM_HINT_T0);
    const D U(up);
    for (int bb = 0; bb < D::kUnit / 32; ++bb) {
      const int64_t b = un * (D::kUnit / 32) + bb;
      // both halves' codes into L1 (16 registers would not fit beside the rest): each activation quad is
      // broadcast once for the 16 weight rows (Q6_K 1.35x, the others 1.0-1.15x against a half at a time)
      U.codes(bb, 0, wc[0], sgn[0]);
      U.codes(bb, 1, wc[1], sgn[1]);
#pragma GCC unroll 2
      for (int s = 0; s < kSubs; ++s) {
        const __m256 ws0 = U.scale(bb, s, 0), ws1 = U.scale(bb, s, 1);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xp = xq[m] + 32 * b + D::kSub * s;
          __m256i i0 = D::kOff ? _mm256_set1_epi32(xi[m][b * kSubs + s]) : _mm256_setzero_si256(), i1 = i0;
#pragma GCC unroll 8
          for (int r = 0; r < kQuads; r += D::kRun) {
            __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = r; j < r + D::kRun; ++j) {
              const int q = s * kQuads + j;
              const __m256i x = _mm256_set1_epi32((int)load_u32(reinterpret_cast<const uint8_t*>(xp + 4 * j)));
              __m256i x0 = x, x1 = x;
              if constexpr (D::kSigned) {
                x0 = _mm256_sign_epi8(x, _mm256_load_si256(&sgn[0][q]));
                x1 = _mm256_sign_epi8(x, _mm256_load_si256(&sgn[1][q]));
              }
              p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(_mm256_load_si256(&wc[0][q]), x0));
              p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(_mm256_load_si256(&wc[1][q]), x1));
            }
            i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(p0, ones));
            i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(p1, ones));
          }
          const __m256 dx = _mm256_set1_ps(xd[m][b]);
          acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(ws0, dx), acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(ws1, dx), acc[m][1]);
        }
      }
      if constexpr (D::kMin) {
        const __m256 mv0 = U.minv(bb, 0), mv1 = U.minv(bb, 1);
        for (int m = 0; m < MR; ++m) {
          const __m256 sx = _mm256_set1_ps(xs[m][b]);
          acc[m][0] = D::kMinNeg ? _mm256_fnmadd_ps(mv0, sx, acc[m][0]) : _mm256_fmadd_ps(mv0, sx, acc[m][0]);
          acc[m][1] = D::kMinNeg ? _mm256_fnmadd_ps(mv1, sx, acc[m][1]) : _mm256_fmadd_ps(mv1, sx, acc[m][1]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(out + m * ldo, acc[m][0]);
    _mm256_storeu_ps(out + m * ldo + 8, acc[m][1]);
  }
}

template <class D>
void fill(TypeKernels& k) {
  k.tile[0] = tile<D, 1>; k.tile[1] = tile<D, 2>; k.tile[2] = tile<D, 3>; k.tile[3] = tile<D, 4>;
  k.tile[4] = tile<D, 5>; k.tile[5] = tile<D, 6>; k.tile[6] = tile<D, 7>; k.tile[7] = tile<D, 8>;
  k.act_off = D::kOff;
  k.act_sub = D::kSub;
}

}  // namespace

// The avx2_tiles form's tile kernels, in its type ids' slots (kRepackedAvx2 + the GGML id).
void register_avx2_tiles(TypeKernels* table) {
  fill<Legacy<8, false, false, false>>(table[table_index(kRepackedAvx2 + kQ4_0)]);
  fill<Legacy<0, true, false, false>>(table[table_index(kRepackedAvx2 + kQ4_1)]);
  fill<Legacy<16, false, true, false>>(table[table_index(kRepackedAvx2 + kQ5_0)]);
  fill<Legacy<0, true, true, false>>(table[table_index(kRepackedAvx2 + kQ5_1)]);
  fill<Legacy<128, false, false, true>>(table[table_index(kRepackedAvx2 + kQ8_0)]);
  fill<K45<false>>(table[table_index(kRepackedAvx2 + kQ4_K)]);
  fill<K45<true>>(table[table_index(kRepackedAvx2 + kQ5_K)]);
  fill<Q6K>(table[table_index(kRepackedAvx2 + kQ6_K)]);
}

}  // namespace vavx2
}  // namespace tq
