// The unit descriptors of the repacked layouts (repacked.h) for the AVX-512 kernel forms: each decodes
// a 32-block of 16 weight rows into 8 registers of unsigned codes (quad j: inputs 4j..4j+3 of the 16
// rows) and gives the weight scales (and mins) as 16 fp32 lanes. Included by qmm_vnni512.cpp and
// qmm_amx.cpp after their target pragmas, inside an anonymous namespace: each translation unit has its
// own copy, compiled for its own target.
#pragma once

inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512i ld(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline int32_t ld32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t ld64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Quads 0..3 (low nibbles) and 4..7 (high nibbles) of a 256-byte nib field.
inline void nibbles(const uint8_t* nib, __m512i w[8]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = ld(nib + 64 * j);
    w[j] = _mm512_and_si512(v, m4);
    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  }
}

// + 16 where an hmask field's bit is set (the fifth bit of Q5_0 / Q5_1 / Q5_K codes).
inline void fifth_bits(const uint8_t* hm, __m512i w[8]) {
  const __m512i c16 = _mm512_set1_epi8(16);
  for (int j = 0; j < 8; ++j) w[j] = _mm512_mask_add_epi8(w[j], _cvtu64_mask64(ld64(hm + 8 * j)), w[j], c16);
}

// ---- unit descriptors: codes of a 32-block, weight scales and mins as 16 fp32 lanes -----------

// Q4_0 (OFF 8), Q4_1 (MIN), Q5_0 (Q5, OFF 16), Q5_1 (Q5, MIN), Q8_0 (Q8, OFF 128).
template <int OFF, bool MIN, bool Q5, bool Q8>
struct Legacy {
  static constexpr int kUnit = 32, kSub = 32, kOff = OFF;
  static constexpr bool kMin = MIN, kMinNeg = false;
  static constexpr int kBytes = kGroupRows * (Q8 ? 34 : 18 + (MIN ? 2 : 0) + (Q5 ? 4 : 0));
  static constexpr int kHm = 32 + (MIN ? 32 : 0), kCodes = kHm + (Q5 ? 64 : 0);
  const uint8_t* u;
  explicit Legacy(const uint8_t* p) : u(p) {}
  inline void codes(int, __m512i w[8]) const {
    if constexpr (Q8) {
      for (int j = 0; j < 8; ++j) w[j] = ld(u + kCodes + 64 * j);
    } else {
      nibbles(u + kCodes, w);
      if constexpr (Q5) fifth_bits(u + kHm, w);
    }
  }
  inline __m512 scale(int, int) const { return f16x16(u); }
  inline __m512 minv(int) const { return f16x16(u + 32); }
};

// Q4_K / Q5_K: per 32-block bb, scale d sc_bb and min dmin m_bb (6-bit integers unpacked for 16 rows).
template <bool Q5>
struct K45 {
  static constexpr int kUnit = 256, kSub = 32, kOff = 0;
  static constexpr bool kMin = true, kMinNeg = true;
  static constexpr int kBytes = kGroupRows * (Q5 ? 176 : 144);
  static constexpr int kHm = 256, kNib = Q5 ? 256 + 512 : 256;
  const uint8_t* u;
  __m512 d, dmin;
  __m512i sc[2], mn[2];  // 4 bytes per lane: scales / mins of blocks 0-3 and 4-7
  explicit K45(const uint8_t* p) : u(p) {
    d = f16x16(p);
    dmin = f16x16(p + 32);
    const __m512i a = ld(p + 64), b = ld(p + 128), c = ld(p + 192);
    const __m512i m6 = _mm512_set1_epi32(0x3F3F3F3F), m4 = _mm512_set1_epi32(0x0F0F0F0F),
                  m30 = _mm512_set1_epi32(0x30303030);
    sc[0] = _mm512_and_si512(a, m6);
    mn[0] = _mm512_and_si512(b, m6);
    sc[1] = _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_and_si512(_mm512_srli_epi32(a, 2), m30));
    mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), m4), _mm512_and_si512(_mm512_srli_epi32(b, 2), m30));
  }
  static inline __m512 byte_of(__m512i v, int i) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF)));
  }
  inline void codes(int bb, __m512i w[8]) const {
    nibbles(u + kNib + 256 * bb, w);
    if constexpr (Q5) fifth_bits(u + kHm + 64 * bb, w);
  }
  inline __m512 scale(int bb, int) const { return _mm512_mul_ps(d, byte_of(sc[bb / 4], bb % 4)); }
  inline __m512 minv(int bb) const { return _mm512_mul_ps(dmin, byte_of(mn[bb / 4], bb % 4)); }
};

// Q6_K: 16-input sub-blocks with int8 scales; codes 0..63, offset 32.
struct Q6K {
  static constexpr int kUnit = 256, kSub = 16, kOff = 32;
  static constexpr bool kMin = false, kMinNeg = false;
  static constexpr int kBytes = kGroupRows * 210;
  const uint8_t* u;
  __m512 d;
  explicit Q6K(const uint8_t* p) : u(p), d(f16x16(p)) {}
  inline void codes(int bb, __m512i w[8]) const {
    const uint8_t* blk = u + 288 + 384 * bb;
    nibbles(blk, w);
    const __m512i c30 = _mm512_set1_epi8(0x30);
    for (int t = 0; t < 2; ++t) {
      const __m512i h = ld(blk + 256 + 64 * t);
      const __m512i hs[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};
      for (int jj = 0; jj < 4; ++jj) w[4 * t + jj] = _mm512_ternarylogic_epi32(w[4 * t + jj], hs[jj], c30, 0xF8);
    }
  }
  inline __m512 scale(int bb, int s) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 32 + 16 * (2 * bb + s)));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
  }
  inline __m512 minv(int) const { return _mm512_setzero_ps(); }
};

// Each repacked type's GGML id and unit descriptor: visit(ggml_id, (D*)nullptr) for every type, the one
// list both forms register their kernels from.
template <class Visit>
inline void each_unit(Visit&& visit) {
  visit(kQ4_0, static_cast<Legacy<8, false, false, false>*>(nullptr));
  visit(kQ4_1, static_cast<Legacy<0, true, false, false>*>(nullptr));
  visit(kQ5_0, static_cast<Legacy<16, false, true, false>*>(nullptr));
  visit(kQ5_1, static_cast<Legacy<0, true, true, false>*>(nullptr));
  visit(kQ8_0, static_cast<Legacy<128, false, false, true>*>(nullptr));
  visit(kQ4_K, static_cast<K45<false>*>(nullptr));
  visit(kQ5_K, static_cast<K45<true>*>(nullptr));
  visit(kQ6_K, static_cast<Q6K*>(nullptr));
}

// The float steps every AVX-512 form takes per block, in this order, from the exact integer sums:
// sub-block s adds float(isum) * (w_scale * d_x); a type with a min then adds (or, kMinNeg, subtracts)
// w_min * s32_x. qmm_vnni512.cpp and qmm_amx.cpp both call these, so their rows are the same bits.
inline __m512 add_block(__m512 acc, __m512i isum, __m512 ws, float dx) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws, _mm512_set1_ps(dx)), acc);
}
template <class D>
inline __m512 add_min(__m512 acc, __m512 mv, float s32) {
  const __m512 s = _mm512_set1_ps(s32);
  return D::kMinNeg ? _mm512_fnmadd_ps(mv, s, acc) : _mm512_fmadd_ps(mv, s, acc);
}

