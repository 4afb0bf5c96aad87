// One key step of the tiled attention kernel (flash_attention.cpp), written once over a vector type V
// so that its AVX-512 (flash_attention512.cpp), AVX2 and portable forms give the same bits.
//
// A task's rows (its new tokens x the query heads of one KV head) sit in vector lanes: the queries are
// held transposed, qt[d][r], so a score is one lane's chain of fused multiply-adds over d,
//   s[j][r] = fma(qt[D-1][r], k[j][D-1], ... fma(qt[0][r], k[j][0], 0)) * scale,
// and an output element one lane's chain over the keys, acc[r][d] = fma(p[j][r], v[j][d], acc[r][d]) for
// j in order. The online softmax runs lane by lane too (the same exp polynomial in every form). Nothing
// crosses lanes, so the vector width decides only how many rows (or columns) run at once, never the
// result: an 8-wide and a 16-wide register, or a scalar, give every output the same bits
// (tests/test_flash_attention.py compares them). A row's result does not depend on the other rows of
// its tile either.
//
// Per step the scores are n x Rp floats (the keys x the rows rounded up to whole vectors); the keys and
// values of the step are float32 rows the caller points at: in the cache (float32 K/V) or widened or
// dequantized into its own buffer (float16, int8, int4).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace atile {

struct Step {
  const float* qt;  // [D][Rp] the rows' queries, transposed (pad rows zero)
  const float* const* krows;  // n rows of D: this step's keys
  const float* const* vrows;  // and values
  const int64_t* a;  // [Rp] row r sees the keys [a[r], e[r]) of this step (0 <= a <= e <= n)
  const int64_t* e;
  int64_t R, Rp, D, n;  // rows, rows rounded up to the vector width, head dim, keys (<= 64)
  float scale, cap;     // score scale, soft-cap (0: none)
  float* st;   // scratch [n][Rp]: scores, then probabilities
  float* cr;   // scratch [Rp]: each row's rescale factor
  float* m;    // [Rp] running maximum
  float* l;    // [Rp] running sum of exp
  float* acc;  // [R][D] unnormalized output
};

// Everything below is local to each translation unit that includes this header: each compiles it for
// its own target (flash_attention512.cpp under an AVX-512 pragma), so no function is shared between them.
namespace {

// The portable form: one lane. Each operation rounds as its vector counterpart does, lane for lane.
struct VecS {
  using T = float;
  static constexpr int W = 1;
  static constexpr int kQkRows = 4, kPvRows = 4;  // register blocking: row vectors per score block, rows per P V block
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T set1(float x) { return x; }
  static T zero() { return 0.f; }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T max(T a, T b) { return a > b ? a : b; }  // maxps: the second operand unless the first is greater
  static T min(T a, T b) { return a < b ? a : b; }
  static T round(T x) { return std::nearbyint(x); }  // to nearest, ties to even (the default rounding mode)
  static T pow2(T n) {  // 2^n for an integral n in [-127, 128]: the exponent bits
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static T zero_where_ninf(T x, T v) { return x == -std::numeric_limits<float>::infinity() ? 0.f : v; }
};

#ifdef __AVX2__
// The AVX2 form: eight lanes.
struct Vec8 {
  using T = __m256;
  static constexpr int W = 8;
  // 16 registers: 3 x 4 score accumulators + 3 query vectors + a key; 2 x 4 output vectors + 4 of V + a weight
  // (4 x 4 spilled: 0.75-0.8x the kernel before this one at head dim 256, measured on the Xeon)
  static constexpr int kQkRows = 3, kPvRows = 2;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T zero() { return _mm256_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static T zero_where_ninf(T x, T v) {
    const T ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
  }
};
#endif

// exp(x) lane by lane: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (relative error
// ~2e-7), 2^n from the exponent bits; the argument clamped to [-87.3, 88.3] (vec_math.h's exp256).
template <class V>
inline typename V::T vexp(typename V::T x) {
  x = V::min(V::max(x, V::set1(-87.3f)), V::set1(88.3f));
  const auto n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  auto r = V::fma(V::sub(V::zero(), n), V::set1(0.693359375f), x);
  r = V::fma(V::sub(V::zero(), n), V::set1(-2.12194440e-4f), r);
  auto p = V::set1(1.0f / 720);
  p = V::fma(p, r, V::set1(1.0f / 120));
  p = V::fma(p, r, V::set1(1.0f / 24));
  p = V::fma(p, r, V::set1(1.0f / 6));
  p = V::fma(p, r, V::set1(0.5f));
  p = V::fma(p, r, V::set1(1.0f));
  p = V::fma(p, r, V::set1(1.0f));
  return V::mul(p, V::pow2(n));
}

// scores of NV row vectors x NK keys from j0: NV * NK accumulators, one fma each per d
template <class V, int NV, int NK>
inline void qk_block(const Step& s, int64_t v0, int64_t j0) {
  typename V::T acc[NV][NK];
  for (int v = 0; v < NV; ++v)
    for (int k = 0; k < NK; ++k) acc[v][k] = V::zero();
  const float* q = s.qt + v0 * V::W;
  const float* kr[NK];
  for (int k = 0; k < NK; ++k) kr[k] = s.krows[j0 + k];
  for (int64_t d = 0; d < s.D; ++d) {
    typename V::T qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = V::load(q + d * s.Rp + v * V::W);
    for (int k = 0; k < NK; ++k) {
      const auto kb = V::set1(kr[k][d]);
      for (int v = 0; v < NV; ++v) acc[v][k] = V::fma(qv[v], kb, acc[v][k]);
    }
  }
  const auto sc = V::set1(s.scale);
  for (int k = 0; k < NK; ++k)
    for (int v = 0; v < NV; ++v) V::store(s.st + (j0 + k) * s.Rp + (v0 + v) * V::W, V::mul(acc[v][k], sc));
}

template <class V, int NV>
inline void qk_rows(const Step& s, int64_t v0) {
  int64_t j0 = 0;
  for (; j0 + 4 <= s.n; j0 += 4) qk_block<V, NV, 4>(s, v0, j0);
  switch (s.n - j0) {
    case 3: qk_block<V, NV, 3>(s, v0, j0); break;
    case 2: qk_block<V, NV, 2>(s, v0, j0); break;
    case 1: qk_block<V, NV, 1>(s, v0, j0); break;
    default: break;
  }
}

// acc[r0 .. r0 + NR)[d0 .. d0 + NC * W) += sum_j p[j][r] v[j][...]: NR * NC accumulators over the keys
template <class V, int NR, int NC>
inline void pv_block(const Step& s, int64_t r0, int64_t d0) {
  typename V::T a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = V::load(s.acc + (r0 + r) * s.D + d0 + c * V::W);
  for (int64_t j = 0; j < s.n; ++j) {
    typename V::T vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = V::load(s.vrows[j] + d0 + c * V::W);
    for (int r = 0; r < NR; ++r) {
      const auto p = V::set1(s.st[j * s.Rp + r0 + r]);
      for (int c = 0; c < NC; ++c) a[r][c] = V::fma(p, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) V::store(s.acc + (r0 + r) * s.D + d0 + c * V::W, a[r][c]);
}

template <class V, int NC>
inline void pv_cols(const Step& s, int64_t d0) {
  constexpr int NR = V::kPvRows;
  int64_t r0 = 0;
  for (; r0 + NR <= s.R; r0 += NR) pv_block<V, NR, NC>(s, r0, d0);
  for (; r0 < s.R; ++r0) pv_block<V, 1, NC>(s, r0, d0);
}

template <class V>
inline void pv(const Step& s) {
  constexpr int W = V::W;
  int64_t d0 = 0;
  for (; d0 + 4 * W <= s.D; d0 += 4 * W) pv_cols<V, 4>(s, d0);
  for (; d0 + W <= s.D; d0 += W) pv_cols<V, 1>(s, d0);
#ifdef __AVX2__
  if constexpr (W > 8)  // an 8-column rest in the AVX2 form's registers (the same chains)
    for (; d0 + 8 <= s.D; d0 += 8) pv_cols<Vec8, 1>(s, d0);
#endif
  if (d0 < s.D)  // the columns past the last whole vector, one lane at a time (the same fma chains)
    for (int64_t d = d0; d < s.D; ++d) pv_cols<VecS, 1>(s, d);
}

// One step: scores, mask, online softmax (rescale m, l, acc), acc += P V.
template <class V>
void step(const Step& s) {
  constexpr int W = V::W;
  const int64_t NV = s.Rp / W, n = s.n, Rp = s.Rp;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t v0 = 0; v0 < NV; v0 += V::kQkRows) {
    switch (std::min<int64_t>(V::kQkRows, NV - v0)) {
      case 4: qk_rows<V, 4>(s, v0); break;
      case 3: qk_rows<V, 3>(s, v0); break;
      case 2: qk_rows<V, 2>(s, v0); break;
      default: qk_rows<V, 1>(s, v0); break;
    }
  }
  if (s.cap > 0.f)
    for (int64_t i = 0; i < n * Rp; ++i) s.st[i] = std::tanh(s.st[i] / s.cap) * s.cap;
  for (int64_t r = 0; r < Rp; ++r) {  // keys a row does not see
    for (int64_t j = 0; j < s.a[r]; ++j) s.st[j * Rp + r] = ninf;
    for (int64_t j = s.e[r]; j < n; ++j) s.st[j * Rp + r] = ninf;
  }
  for (int64_t v = 0; v < NV; ++v) {
    const int64_t o = v * W;
    const auto m_old = V::load(s.m + o);
    auto mx = m_old;
    for (int64_t j = 0; j < n; ++j) mx = V::max(mx, V::load(s.st + j * Rp + o));
    // a row that has seen no key yet keeps m = -inf: its exponents are taken against 0 and zeroed
    const auto base = V::zero_where_ninf(mx, mx);
    const auto corr = V::zero_where_ninf(m_old, vexp<V>(V::sub(m_old, base)));
    auto sum = V::zero();
    for (int64_t j = 0; j < n; ++j) {
      const auto x = V::load(s.st + j * Rp + o);
      const auto p = V::zero_where_ninf(x, vexp<V>(V::sub(x, base)));
      V::store(s.st + j * Rp + o, p);
      sum = V::add(sum, p);
    }
    V::store(s.l + o, V::add(V::mul(V::load(s.l + o), corr), sum));
    V::store(s.m + o, mx);
    V::store(s.cr + o, corr);
  }
  for (int64_t r = 0; r < s.R; ++r) {  // rescale what each row has: lane by lane, one multiply
    const float c = s.cr[r];
    float* o = s.acc + r * s.D;
    int64_t d = 0;
    for (; d + W <= s.D; d += W) V::store(o + d, V::mul(V::load(o + d), V::set1(c)));
    for (; d < s.D; ++d) o[d] *= c;
  }
  pv<V>(s);
}

}  // namespace
}  // namespace atile
