// Row maxima of a non-negative matrix under many column scalings at once, for the int8 method's
// equalization search (turbollm/quantization/equalize.py, `rtn_errors`; its PyTorch reference,
// one product matrix per candidate, is there too):
//
//     out[k, i] = max_j absw[i, j] * cands[k, j]
//
// One pass over the matrix serves every candidate: rows are taken `kRows` at a time (they stay
// in L1) against each candidate's scale row, so the matrix is read from memory once instead of
// once per candidate and no product matrix is written. Each product is the same float32
// multiply the reference does and the maximum is exact, so the results are identical.
#include "ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;

#ifdef __AVX2__
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

// Rows [row0, row0 + nrows) of w (row length C) against every candidate; nrows <= kRows.
void row_block(const float* w, int64_t nrows, int64_t C, const float* cands, int64_t K, float* out,
               int64_t R, int64_t row0) {
  for (int64_t k = 0; k < K; ++k) {
    const float* c = cands + k * C;
    float m[kRows] = {0.f, 0.f, 0.f, 0.f};
    int64_t j = 0;
#ifdef __AVX2__
    if (nrows == kRows) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      for (; j + 8 <= C; j += 8) {
        const __m256 cv = _mm256_loadu_ps(c + j);
        a0 = _mm256_max_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(w + j), cv));
        a1 = _mm256_max_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(w + C + j), cv));
        a2 = _mm256_max_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(w + 2 * C + j), cv));
        a3 = _mm256_max_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(w + 3 * C + j), cv));
      }
      m[0] = hmax(a0), m[1] = hmax(a1), m[2] = hmax(a2), m[3] = hmax(a3);
    }
#endif
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t t = j; t < C; ++t) m[r] = std::max(m[r], w[r * C + t] * c[t]);
    for (int64_t r = 0; r < nrows; ++r) out[k * R + row0 + r] = m[r];
  }
}

}  // namespace

torch::Tensor scaled_row_max(torch::Tensor absw, torch::Tensor cands) {
  TORCH_CHECK(absw.dim() == 2 && cands.dim() == 2, "absw [R, C] and cands [K, C] must be 2-D");
  TORCH_CHECK(absw.dtype() == torch::kFloat32 && cands.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(absw.is_contiguous() && cands.is_contiguous(), "absw and cands must be contiguous");
  TORCH_CHECK(absw.size(1) == cands.size(1), "absw has ", absw.size(1), " columns, cands ", cands.size(1));
  const int64_t R = absw.size(0), C = absw.size(1), K = cands.size(0);
  auto out = torch::empty({K, R}, absw.options());
  const float* w = absw.data_ptr<float>();
  const float* c = cands.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t blocks = (R + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row0 = b * kRows;
      row_block(w + row0 * C, std::min(kRows, R - row0), C, c, K, o, R, row0);
    }
  });
  return out;
}
