// Activation quantization: fp32 rows -> int8 blocks of 32 or 256 (see quant_common.h), with an
// optional second level: the residual x - d q quantized again (x ~ d1 q1 + d2 q2, ~15 bits).
// Reference: quant.py quantize_activations_ref (bit-exact: same fp32 operations, ties to even).
#include "quant_common.h"

#include <cmath>

namespace tq {
namespace {

// d = amax / 127 and its inverse (0 for an all-zero block), as the reference computes them.
static inline void block_scale(float amax, float* d, float* id) {
  *d = amax / 127.f;
  *id = *d != 0.f ? 1.f / *d : 0.f;
}

// Quantize n values (a multiple of 16) with inverse scale id; returns nothing, writes q and the
// integer sums of each 16 values into sums16.
static void quantize_scalar(const float* x, int n, float id, int8_t* q, int* sums16) {
  for (int g = 0; g < n / 16; ++g) {
    int s = 0;
    for (int i = 16 * g; i < 16 * g + 16; ++i) {
      const int v = (int)std::nearbyint(x[i] * id);  // default rounding mode: ties to even
      q[i] = (int8_t)v;
      s += v;
    }
    sums16[g] = s;
  }
}

static float amax_scalar(const float* x, int n) {
  float m = 0.f;
  for (int i = 0; i < n; ++i) m = std::fmax(m, std::fabs(x[i]));
  return m;
}

#ifdef __AVX2__
static inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

static float amax_avx2(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// 32 values at a time: round(x * id) -> int8 (in order), plus the two sums of 16.
static void quantize_avx2(const float* x, int n, float id, int8_t* q, int* sums16) {
  const __m256 vid = _mm256_set1_ps(id);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int b = 0; b < n; b += 32) {
    __m256i i[4];
    for (int j = 0; j < 4; ++j)
      i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + b + 8 * j), vid), kRound));
    sums16[b / 16] = hsum_i32(_mm256_add_epi32(i[0], i[1]));
    sums16[b / 16 + 1] = hsum_i32(_mm256_add_epi32(i[2], i[3]));
    // the in-lane packs interleave 4-value groups; a permute restores the order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b), p);
  }
}
#endif

static inline float amax_of(const float* x, int n) {
#ifdef __AVX2__
  return amax_avx2(x, n);
#else
  return amax_scalar(x, n);
#endif
}

static inline void quantize_values(const float* x, int n, float id, int8_t* q, int* sums16) {
#ifdef __AVX2__
  quantize_avx2(x, n, id, q, sums16);
#else
  quantize_scalar(x, n, id, q, sums16);
#endif
}

}  // namespace

// Block b of output row r from the `block` values at xb; returns the block scale d.
static float quantize_block(const float* xb, int64_t K, int64_t block, int64_t r, int64_t b, const QActBuf& out) {
  const int64_t db = r * (K / block) + b;              // index of the block's scale
  const int64_t h = r * (K / 16) + b * (block / 16);  // index of its first 16-sum
  float d, id;
  block_scale(amax_of(xb, (int)block), &d, &id);
  int sums[16];
  quantize_values(xb, (int)block, id, out.q + r * K + b * block, sums);
  out.d[db] = d;
  if (block == 32) {
    out.s32[db] = d * (float)(sums[0] + sums[1]);
    out.s16[h] = d * (float)sums[0];
    out.s16[h + 1] = d * (float)sums[1];
  } else {
    for (int g = 0; g < block / 16; ++g) out.bs16[h + g] = (int16_t)sums[g];
  }
  return d;
}

void quantize_rows(const float* x, int64_t K, int64_t block, int64_t m0, int64_t m1, const QActBuf& out,
                   bool residual) {
  float r[256];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < K / block; ++b) {
      const float* xb = x + m * K + b * block;
      if (!residual) {
        quantize_block(xb, K, block, m, b, out);
        continue;
      }
      // rows 2m (x) and 2m + 1 (what the first leaves: x - d q, quantized with its own scale)
      const float d = quantize_block(xb, K, block, 2 * m, b, out);
      const int8_t* q = out.q + 2 * m * K + b * block;
      for (int64_t i = 0; i < block; ++i) r[i] = xb[i] - d * (float)q[i];
      quantize_block(r, K, block, 2 * m + 1, b, out);
    }
  }
  (void)amax_scalar;
  (void)quantize_scalar;
}

void quantize_rows16(const float* x, int64_t K, int64_t block, int64_t m0, int64_t m1, const QActBuf& out) {
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < K / block; ++b) {
      const float* xb = x + m * K + b * block;
      const float d = amax_of(xb, (int)block) / 32767.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int16_t* q = out.q16 + m * K + b * block;
      out.d[m * (K / block) + b] = d;
      for (int64_t c = 0; c < block / 32; ++c) {  // the sums of each 32 and each 16 (times d)
        int sums[2] = {0, 0};
        for (int i = 0; i < 32; ++i) {
          const int v = (int)std::nearbyint(xb[32 * c + i] * id);  // ties to even
          q[32 * c + i] = (int16_t)v;
          sums[i / 16] += v;
        }
        const int64_t b32 = m * (K / 32) + b * (block / 32) + c;
        out.s32[b32] = d * (float)(sums[0] + sums[1]);
        out.s16[2 * b32] = d * (float)sums[0];
        out.s16[2 * b32 + 1] = d * (float)sums[1];
      }
    }
  }
}

void offset_sums(const int8_t* q, int64_t R, int64_t K, int64_t sub, int64_t off, int32_t* init) {
  for (int64_t r = 0; r < R; ++r) {
    const int8_t* row = q + r * K;
    for (int64_t s = 0; s < K / sub; ++s) {
      int32_t sum = 0;
      for (int64_t i = 0; i < sub; ++i) sum += row[s * sub + i];
      init[r * (K / sub) + s] = (int32_t)(-off * sum);
    }
  }
}

}  // namespace tq
