// Fused element-wise ops of a decoder step: RMSNorm (with the residual add), NeoX RoPE in
// place, and the gated activations SiLU(g)*u and GELU_tanh(g)*u.
//
// Each replaces several PyTorch ops (and their temporaries) with one pass over the data;
// at decode, where a step is a few hundred tiny ops, dispatch and allocation dominate those
// ops' cost. float32 only. References: turbollm/layers/{norm,rotary,activation}.py, held
// together with these by tests/test_fused_ops.py.
#include "ops.h"
#include <ATen/Parallel.h>
#include <cmath>

#include "vec_math.h"

namespace {

// Rows are split over threads only when there is enough work to pay for waking them.
constexpr int64_t kParallelGrain = 1 << 15;  // elements

inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(cols, 1)); }

inline float silu1(float g) { return g / (1.0f + std::exp(-g)); }
inline float gelu_tanh1(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.0f + std::tanh(y));
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  __m256 a = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  total = _mm_cvtss_f32(s);
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

}  // namespace

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w. With `residual` given: residual[t] += x[t]
// first (in place) and the sum is normalized.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual) {
  check_f32(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.dtype() == torch::kFloat32, "w must be contiguous float32");
  const int64_t D = x.size(-1);
  TORCH_CHECK(w.numel() == D, "w has ", w.numel(), " elements, rows have ", D);
  auto x2 = x.reshape({-1, D});
  const int64_t T = x2.size(0);
  float* rp = nullptr;
  int64_t rs = 0;
  if (residual.has_value()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->numel() == x.numel(), "residual and x differ in size");
    TORCH_CHECK(residual->dim() == 2 && residual->size(1) == D, "residual must be [T, D]");
    rp = residual->data_ptr<float>();
    rs = residual->stride(0);
  }
  auto out = torch::empty({T, D}, x.options());
  const float* xp = x2.data_ptr<float>();
  const int64_t xs = x2.stride(0);
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = xp + t * xs;
      if (rp) {
        float* r = rp + t * rs;
        for (int64_t i = 0; i < D; ++i) r[i] += src[i];
        src = r;
      }
      const float inv = 1.0f / std::sqrt(sum_squares(src, D) / static_cast<float>(D) + feps);
      float* o = op + t * D;
      for (int64_t i = 0; i < D; ++i) o[i] = src[i] * inv * wp[i];
    }
  };
  if (T * D >= kParallelGrain) at::parallel_for(0, T, grain_rows(D), body); else body(0, T);
  return out.view(x.sizes());
}

// NeoX rotary embedding, in place on q [T, Hq, D] and k [T, Hk, D] (row and head strides free,
// last dim contiguous): for pair (i, i + D/2) at position p, angle = p * inv_freq[i], with
// cos/sin tables [P, D/2] indexed by positions [T].
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  check_f32(q, "q");
  check_f32(k, "k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [T, H, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos/sin tables must be contiguous");
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t T = q.size(0), D = q.size(2), half = D / 2, P = cos.size(0);
  TORCH_CHECK(cos.size(1) == half, "cos table has ", cos.size(1), " columns, expected ", half);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "position ", pp[t], " outside the RoPE table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](torch::Tensor x, int64_t t) {
    float* base = x.data_ptr<float>() + t * x.stride(0);
    const float* c = cp + pp[t] * half;
    const float* s = sp + pp[t] * half;
    for (int64_t h = 0; h < x.size(1); ++h) {
      float* a = base + h * x.stride(1);
      float* b = a + half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * s[i];
        b[i] = x2 * c[i] + x1 * s[i];
      }
    }
  };
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate(q, t);
      rotate(k, t);
    }
  };
  const int64_t per_row = (q.size(1) + k.size(1)) * D;
  if (T * per_row >= kParallelGrain) at::parallel_for(0, T, grain_rows(per_row), body); else body(0, T);
}

// act(gate) * up for a merged [T, 2I] projection (gate first); act: 0 = SiLU, 1 = GELU (tanh).
torch::Tensor gated_act(torch::Tensor gate_up, int64_t act) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * gs;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#ifdef __AVX2__
      const __m256 one = _mm256_set1_ps(1.0f);
      if (act == 0) {
        for (; i + 8 <= I; i += 8) {
          __m256 gv = _mm256_loadu_ps(g + i);
          __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
          __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
      } else {
        // 0.5 g (1 + tanh y) = g * sigmoid(2y) = g / (1 + exp(-2y))
        const __m256 c0 = _mm256_set1_ps(-2.0f * 0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
        for (; i + 8 <= I; i += 8) {
          __m256 gv = _mm256_loadu_ps(g + i);
          __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(c1, gv), _mm256_mul_ps(gv, gv), gv);
          __m256 e = exp256(_mm256_mul_ps(c0, inner));
          __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < I; ++i) o[i] = (act == 0 ? silu1(g[i]) : gelu_tanh1(g[i])) * u[i];
    }
  };
  if (T * I >= kParallelGrain) at::parallel_for(0, T, grain_rows(I), body); else body(0, T);
  return out;
}
