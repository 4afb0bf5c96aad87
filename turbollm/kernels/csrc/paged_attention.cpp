// Decode attention over the paged KV cache: one new query token per sequence.
//
// Work is split over (sequence, KV head) pairs. For each pair the G = Hq/Hk query heads of
// the group read every cached key and value row of that KV head once (GQA/MQA without
// repeating K/V), straight from the blocks named by the block table: no gather copy.
// Reference: turbollm/attention/backend.py attend_decode_batch (tests hold them together).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
#else
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
#endif
}

static inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hk = k_cache.size(2), W = bt.size(1);
  const int64_t G = Hq / Hk;
  auto out = torch::zeros({B, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / Hk, h = job % Hk;
      const int64_t L = lp[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - start;
      if (n <= 0) continue;
      scores.assign(G * n, 0.f);
      const float* qg = qp + (b * Hq + h * G) * D;
      for (int64_t t = start; t < L; ++t) {
        const int64_t block = btp[b * W + t / BS];
        const float* krow = kp + ((block * BS + t % BS) * Hk + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          float s = dot(qg + g * D, krow, D) * fscale;
          if (cap > 0.f) s = std::tanh(s / cap) * cap;
          scores[g * n + (t - start)] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { s[i] = std::exp(s[i] - m); sum += s[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) s[i] *= inv;
      }
      float* og = op + (b * Hq + h * G) * D;
      for (int64_t t = start; t < L; ++t) {
        const int64_t block = btp[b * W + t / BS];
        const float* vrow = vp + ((block * BS + t % BS) * Hk + h) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + (t - start)], vrow, og + g * D, D);
      }
    }
  });
  return out;
}
