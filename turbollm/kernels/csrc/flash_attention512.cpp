// The AVX-512 form of the tiled attention's key step (attention_tile.h): sixteen rows a register where
// the AVX2 form holds eight, the same chains of fused multiply-adds lane for lane, so the same bits
// (tests/test_flash_attention.py compares the forms). flash_attention.cpp calls it when the CPU has
// AVX-512 F.
//
// Compiled for AVX-512 by the target pragma below, after the standard headers (as qmm_vnni512.cpp):
// attention_tile.h's functions are local to each translation unit, so this copy is the only one built
// for AVX-512.
#if defined(__x86_64__) || defined(_M_X64)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <limits>

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

#include "attention_tile.h"

namespace atile {
namespace {

struct Vec16 {
  using T = __m512;
  static constexpr int W = 16;
  static constexpr int kQkRows = 4, kPvRows = 4;  // 32 registers: 4 x 4 accumulators and their operands
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T zero() { return _mm512_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static T zero_where_ninf(T x, T v) {
    const __mmask16 k = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~k), v);
  }
};

}  // namespace

void step_avx512(const Step& s) { step<Vec16>(s); }

}  // namespace atile

#pragma GCC pop_options
#endif
