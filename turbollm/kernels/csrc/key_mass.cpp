// Attention mass per block-table entry, for attention-score eviction (turbollm/core/kv_eviction.py;
// the PyTorch reference is turbollm/attention/key_mass.py, held equal by tests/test_kv_eviction.py).
//
// For sequence b, each counted row r (first_rows[b] <= r < query_start_loc[b + 1]) sees the keys
// 0 .. seq_lens[b] - (qsl[b + 1] - r) of its (compacted) table; the softmax probabilities of every
// query head over them, summed over heads and counted rows, are added per table entry into
// out[b, j / block_size]. Run after the layer's K/V are stored; one task per (sequence, KV head),
// each with its own partial row, summed into `out` at the end.
#include <ATen/Parallel.h>

#include <vector>

#include "attention_simd.h"
#include "ops.h"

namespace {

template <class T>
void key_mass_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& tables,
                   const int64_t* qsl, const int64_t* lens, const int64_t* first, float scale, float softcap,
                   torch::Tensor& out) {
  const int64_t B = tables.size(0), W = tables.size(1), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), G = Hq / Hk;
  const float* qp = q.data_ptr<float>();
  const int64_t q_stride = q.stride(0);
  const T* kc = reinterpret_cast<const T*>(k_cache.data_ptr());
  const int64_t* tb = tables.data_ptr<int64_t>();
  torch::Tensor part = torch::zeros({B, Hk, W}, torch::kFloat32);
  float* pp = part.data_ptr<float>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s, mass;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / Hk, h = task % Hk, len = lens[b], end = qsl[b + 1];
      if (first[b] >= end || len <= 0) continue;
      s.assign(len, 0.f);
      mass.assign(len, 0.f);
      for (int64_t r = first[b]; r < end; ++r) {
        const int64_t n = len - (end - r) + 1;  // keys this row sees
        for (int64_t g = 0; g < G; ++g) {
          const float* qr = qp + r * q_stride + (h * G + g) * D;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            const T* kr = kc + ((tb[b * W + j / bs] * bs + j % bs) * Hk + h) * D;
            float v = dot(qr, kr, D) * scale;
            if (softcap > 0.f) v = std::tanh(v / softcap) * softcap;
            s[j] = v;
            mx = std::max(mx, v);
          }
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
          const float inv = 1.f / sum;
          for (int64_t j = 0; j < n; ++j) mass[j] += s[j] * inv;
        }
      }
      float* row = pp + task * W;
      for (int64_t j = 0; j < len; ++j) row[j / bs] += mass[j];
    }
  });
  out.add_(part.sum(1));
}

}  // namespace

void paged_key_mass(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_tables, torch::Tensor query_start_loc,
                    torch::Tensor seq_lens, torch::Tensor first_rows, double scale, double softcap, torch::Tensor out) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [T, Hq, D] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kFloat16),
              "the K cache must be contiguous float32 or float16");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "q and the K cache disagree");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == block_tables.size(0) && out.size(1) >= block_tables.size(1),
              "out must be contiguous float32 [B, >= table width]");
  const auto tables = block_tables.to(torch::kInt64).contiguous();
  const auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  const auto lens = seq_lens.to(torch::kInt64).contiguous();
  const auto first = first_rows.to(torch::kInt64).contiguous();
  const int64_t B = tables.size(0);
  TORCH_CHECK(qsl.numel() == B + 1 && lens.numel() == B && first.numel() == B, "one row start, length and first row per sequence");
  torch::Tensor acc = out.narrow(1, 0, tables.size(1));
  if (k_cache.dtype() == torch::kFloat16)
    key_mass_impl<at::Half>(q, k_cache, tables, qsl.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                            first.data_ptr<int64_t>(), (float)scale, (float)softcap, acc);
  else
    key_mass_impl<float>(q, k_cache, tables, qsl.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                         first.data_ptr<int64_t>(), (float)scale, (float)softcap, acc);
}
