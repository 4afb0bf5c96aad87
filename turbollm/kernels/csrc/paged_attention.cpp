// Decode attention over the paged KV cache: one new query token per sequence.
//
// Work is split over (sequence, KV head, chunk of kChunk cached positions) tasks, so that even
// one sequence with few KV heads keeps every thread busy (split-K, as in flash-decoding). For
// each task the G = Hq/Hk query heads of the group read each cached key and value row of that
// KV head once (GQA/MQA without repeating K/V), straight from the blocks named by the block
// table: no gather copy. A task leaves its unnormalized partial result (max score m, sum of
// exp l, sum of exp * v); a second pass merges the chunks of each (sequence, head).
//
// The chunking depends only on a sequence's own length, never on the batch, so a sequence's
// output is the same alone and in any batch.
//
// With query_start_loc, a sequence brings several new tokens (at most kSmallQueryMax: a cached
// prompt's tail, speculative verification) and each is attended as a sequence of its own that ends
// at its position, sharing the block table: row j of n new tokens sees the first len - (n - 1 - j)
// positions. Each row is then computed exactly as a one-token decode of that position would be
// (row invariance: a token's output does not depend on the tokens that came with it), at the cost of
// reading the cached K/V once per row rather than once per sequence.
// With attention sinks (StreamingLLM, `sinks` > 0 with a window), a row at position p also sees the
// positions j < sinks older than its window, scored with its row of q_sink (the query rotated to the
// sinks' position): one more task per (row, head), merged with the window's chunks like any chunk.
// Reference: turbollm/attention/backend.py attend_decode_batch / attend_one (tests hold them together).
#include "ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_simd.h"
#include "kv_quant.h"

namespace {

constexpr int64_t kChunk = 256;  // cached positions per task

// The partial attention of G query heads over cached positions [t0, t1) of one KV head.
// off[i] is the element offset of position t0 + i's row in either cache; outputs: m[G], l[G],
// acc[G * D] (unnormalized).
struct Task {
  const float* q;  // [G, D]
  int64_t G, D;
  float scale, cap;
};

template <class T>
void attend_chunk(const Task& tk, int64_t n, const T* kp, const T* vp, const int64_t* off, float* m, float* l,
                  float* acc, std::vector<float>& scores, std::vector<const T*>& rows) {
  const int64_t G = tk.G, D = tk.D;
  scores.resize(G * n);
  rows.resize(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = kp + off[i];
  int64_t i0 = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; i0 + 8 <= n; i0 += 8) {
      prefetch_rows(rows.data() + i0 + 8, std::min<int64_t>(8, n - i0 - 8), D * sizeof(T));
      for (int64_t g = 0; g < G; ++g)
        _mm256_storeu_ps(scores.data() + g * n + i0,
                         _mm256_mul_ps(dot8(tk.q + g * D, rows.data() + i0, D), _mm256_set1_ps(tk.scale)));
    }
  }
#endif
  for (int64_t i = i0; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) scores[g * n + i] = dot(tk.q + g * D, rows[i], D) * tk.scale;
  if (tk.cap > 0.f)
    for (auto& s : scores) s = std::tanh(s / tk.cap) * tk.cap;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    int64_t i = 0;
#ifdef __AVX2__
    __m256 vm = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
    alignas(32) float mlanes[8];
    _mm256_store_ps(mlanes, vm);
    for (float f : mlanes) mx = std::max(mx, f);
#endif
    for (; i < n; ++i) mx = std::max(mx, s[i]);
    m[g] = mx;
    l[g] = exp_sum(s, 0, n, mx);
  }
  for (int64_t i = 0; i < n; ++i) rows[i] = vp + off[i];
  std::fill(acc, acc + G * D, 0.f);
  accum_pv(rows.data(), scores.data(), n, G, acc, D);
}

// attend_chunk for int8 pool positions [t0, t1) of KV head h (kv_quant.h): each block's K rows widened
// once (times their per-channel scales) into a float buffer that stays in L1 while the G query heads
// of the group read it; V read in place as int8, its per-token scale folded into the probabilities.
void attend_chunk_q8(const Task& tk, const QuantKV& s, const int64_t* table, int64_t h, int64_t t0, int64_t t1,
                     float* m, float* l, float* acc, std::vector<float>& scores, std::vector<const int8_t*>& rows,
                     std::vector<float>& qs, std::vector<float>& kf, std::vector<const float*>& krows) {
  const int64_t G = tk.G, D = tk.D, n = t1 - t0, bs = s.bs, H = s.H;
  scores.resize(G * n);
  rows.resize(n);
  qs.resize(D);
  float* ksf = qs.data();  // the block's K scales as floats
  const int8_t* kq = reinterpret_cast<const int8_t*>(s.kq);
  const int8_t* vq = reinterpret_cast<const int8_t*>(s.vq);
  const float scale = tk.scale;
  kf.resize(bs * D);
  std::vector<const float*>& frows = krows;
  frows.resize(bs);
  for (int64_t t = t0, i = 0; t < t1;) {  // block by block: its K rows widened once (scale applied) into a
    // float buffer that stays in L1 while the G query heads read it
    const int64_t blk = table[t / bs], j0 = t % bs, cnt = std::min(bs - j0, t1 - t);
    const at::Half* ksc = s.ks + (blk * H + h) * D;
    int64_t d = 0;
#ifdef __AVX2__
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(ksf + d, half8(ksc + d));
#endif
    for (; d < D; ++d) ksf[d] = static_cast<float>(ksc[d]);
    const int8_t* base = kq + ((blk * bs + j0) * H + h) * D;
    for (int64_t r = 0; r < cnt; ++r) {
      const int8_t* src = base + r * H * D;
      float* dst = kf.data() + r * D;
      int64_t e = 0;
#ifdef __AVX2__
      for (; e + 8 <= D; e += 8) _mm256_storeu_ps(dst + e, _mm256_mul_ps(load8(src + e), _mm256_loadu_ps(ksf + e)));
#endif
      for (; e < D; ++e) dst[e] = static_cast<float>(src[e]) * ksf[e];
      frows[r] = dst;
    }
    int64_t r = 0;
#ifdef __AVX2__
    if (D % 8 == 0)
      for (; r + 8 <= cnt; r += 8)
        for (int64_t g = 0; g < G; ++g)
          _mm256_storeu_ps(scores.data() + g * n + i + r,
                           _mm256_mul_ps(dot8(tk.q + g * D, frows.data() + r, D), _mm256_set1_ps(scale)));
#endif
    for (; r < cnt; ++r)
      for (int64_t g = 0; g < G; ++g) scores[g * n + i + r] = dot(tk.q + g * D, frows[r], D) * scale;
    i += cnt;
    t += cnt;
  }
  if (tk.cap > 0.f)
    for (auto& x : scores) x = std::tanh(x / tk.cap) * tk.cap;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
    m[g] = mx;
    l[g] = exp_sum(sg, 0, n, mx);
  }
  for (int64_t t = t0, i = 0; t < t1;) {  // V read in place: each token's scale into its probabilities
    const int64_t blk = table[t / bs], j0 = t % bs, cnt = std::min(bs - j0, t1 - t);
    const at::Half* vsc = s.vs + (blk * bs + j0) * H + h;
    const int8_t* base = vq + ((blk * bs + j0) * H + h) * D;
    for (int64_t r = 0; r < cnt; ++r) {
      const float v = static_cast<float>(vsc[r * H]);
      for (int64_t g = 0; g < G; ++g) scores[g * n + i + r] *= v;
      rows[i + r] = base + r * H * D;
    }
    i += cnt;
    t += cnt;
  }
  std::fill(acc, acc + G * D, 0.f);
  accum_pv(rows.data(), scores.data(), n, G, acc, D);
}

template <class T>
torch::Tensor decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache,
                                    const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                    const torch::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                    const c10::optional<torch::Tensor>& query_start_loc, int64_t sinks,
                                    const float* qsp, int64_t qs_stride, const QuantKV* qk = nullptr) {
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hk = k_cache.size(2), W = bt.size(1);
  TORCH_CHECK(qk == nullptr || qsp == nullptr, "attention sinks over quantized K/V are not supported");
  const int64_t G = Hq / Hk, qstride = q.stride(0);
  auto out = torch::zeros({B, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const T* kp = qk ? nullptr : k_cache.data_ptr<T>();
  const T* vp = qk ? nullptr : v_cache.data_ptr<T>();
  // Query row b reads block-table row tab[b] and attends to its first lp[b] positions.
  std::vector<int64_t> row_len(B), row_tab(B);
  const int64_t* sl = lens.data_ptr<int64_t>();
  if (query_start_loc) {
    auto qsl = query_start_loc->to(torch::kInt64).contiguous();
    const int64_t S = qsl.numel() - 1;
    const int64_t* qs = qsl.data_ptr<int64_t>();
    TORCH_CHECK(S == lens.numel() && S <= bt.size(0) && qs[0] == 0 && qs[S] == B,
                "query_start_loc must have one entry per sequence plus one, ending at the number of query rows");
    for (int64_t s = 0; s < S; ++s) {
      const int64_t n = qs[s + 1] - qs[s];
      TORCH_CHECK(n >= 1 && n <= kSmallQueryMax && sl[s] >= n, "sequence ", s, ": ", n,
                  " new tokens (1..", kSmallQueryMax, " and at most its length, ", sl[s], ")");
      for (int64_t j = 0; j < n; ++j) {
        row_tab[qs[s] + j] = s;
        row_len[qs[s] + j] = sl[s] - (n - 1 - j);
      }
    }
  } else {
    TORCH_CHECK(lens.numel() == B && bt.size(0) >= B, "one sequence length and block-table row per query row");
    for (int64_t b = 0; b < B; ++b) { row_tab[b] = b; row_len[b] = sl[b]; }
  }
  const int64_t* tab = row_tab.data();
  const int64_t* lp = row_len.data();
  const int64_t* btp = bt.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // Tasks: for each sequence b, head h, chunk c of its window [start, L), after the chunk of its sinks
  // [0, sink_end) when it has one (c = 0). first[b] is the index of (b, 0, 0); sequence b has nch[b]
  // chunks per head.
  // With quantized K/V, the window's chunks are those of its quantized part [start, qlo) (nqc[b] of
  // them), then those of its float16 ring [qlo, L): a chunk is read from one storage only.
  std::vector<int64_t> first(B + 1, 0), nch(B, 0), start(B, 0), sink_end(B, 0), nqc(B, 0), qend(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lp[b];
    start[b] = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    sink_end[b] = qsp != nullptr ? std::min(sinks, start[b]) : 0;
    if (qk) {
      qend[b] = std::min(L, std::max(start[b], qk->qlo[b]));
      nqc[b] = (qend[b] - start[b] + kChunk - 1) / kChunk;
      nch[b] = nqc[b] + (L - qend[b] + kChunk - 1) / kChunk;
    } else {
      nch[b] = (L > start[b] ? (L - start[b] + kChunk - 1) / kChunk : 0) + (sink_end[b] > 0);
    }
    first[b + 1] = first[b] + Hk * nch[b];
  }
  const int64_t tasks = first[B];
  if (tasks == 0) return out;
  const int64_t part = G * (D + 2);  // m[G], l[G], acc[G * D] per task
  std::vector<float> partial(tasks * part);
  std::vector<int64_t> task_seq(tasks);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = first[b]; j < first[b + 1]; ++j) task_seq[j] = b;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kbuf, vbuf, qs;
    std::vector<const T*> rows;
    std::vector<const float*> frows;
    std::vector<const int8_t*> irows;
    std::vector<const at::Half*> hrows;
    std::vector<int64_t> off;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t b = task_seq[j], r = j - first[b], h = r / nch[b], c = r % nch[b];
      const bool sink = sink_end[b] > 0 && c == 0;
      const int64_t cw = c - (sink_end[b] > 0);  // index among the window's chunks
      int64_t t0 = sink ? 0 : start[b] + cw * kChunk, t1 = sink ? sink_end[b] : std::min(lp[b], t0 + kChunk);
      const int64_t* table = btp + tab[b] * W;
      float* pt = partial.data() + j * part;
      if (qk) {  // quantized K/V: a chunk of the pool's part, or of the ring's
        if (c < nqc[b]) {
          t1 = std::min(qend[b], t0 + kChunk);
        } else {
          t0 = qend[b] + (c - nqc[b]) * kChunk;
          t1 = std::min(lp[b], t0 + kChunk);
        }
        const Task tk{qp + b * qstride + h * G * D, G, D, fscale, cap};
        off.resize(t1 - t0);
        if (c >= nqc[b]) {  // the ring: float16 rows read in place
          const int64_t sl = qk->slot[tab[b]];
          for (int64_t t = t0; t < t1; ++t)
            off[t - t0] = (((sl * qk->m + (t / BS) % qk->m) * BS + t % BS) * Hk + h) * D;
          attend_chunk<at::Half>(tk, t1 - t0, qk->kr, qk->vr, off.data(), pt, pt + G, pt + 2 * G, scores, hrows);
        } else if (qk->bits == 8) {  // int8 read in place, scales folded
          attend_chunk_q8(tk, *qk, table, h, t0, t1, pt, pt + G, pt + 2 * G, scores, irows, qs, kbuf, frows);
        } else {  // int4: dequantized into float rows
          kbuf.resize((t1 - t0) * D);
          vbuf.resize((t1 - t0) * D);
          load_quant_rows(*qk, table, qk->qlo[b], qk->slot[tab[b]], h, t0, t1, kbuf.data(), vbuf.data());
          for (int64_t i = 0; i < t1 - t0; ++i) off[i] = i * D;
          attend_chunk<float>(tk, t1 - t0, kbuf.data(), vbuf.data(), off.data(), pt, pt + G, pt + 2 * G, scores,
                              frows);
        }
      } else {
        off.resize(t1 - t0);  // row offsets, walking the block table (no division per position)
        int64_t blk = t0 / BS, slot = t0 % BS;
        for (int64_t i = 0; i < t1 - t0; ++i) {
          off[i] = ((table[blk] * BS + slot) * Hk + h) * D;
          if (++slot == BS) { slot = 0; ++blk; }
        }
        const Task tk{(sink ? qsp + b * qs_stride : qp + b * qstride) + h * G * D, G, D, fscale, cap};
        attend_chunk<T>(tk, t1 - t0, kp, vp, off.data(), pt, pt + G, pt + 2 * G, scores, rows);
      }
      if (nch[b] == 1) {  // the whole window in one chunk: normalize into the output now
        float* og = op + (b * Hq + h * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.f / pt[G + g];
          for (int64_t d = 0; d < D; ++d) og[g * D + d] = pt[2 * G + g * D + d] * inv;
        }
      }
    }
  });

  // merge the chunks of each (sequence, head): rescale to the common max, normalize
  // (sequences of one chunk were written by their task)
  at::parallel_for(0, B * Hk, 8, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / Hk, h = job % Hk, C = nch[b];
      if (C <= 1) continue;
      float* og = op + (b * Hq + h * G) * D;  // zeros (torch::zeros)
      const float* p0 = partial.data() + (first[b] + h * C) * part;
      for (int64_t g = 0; g < G; ++g) merge_parts_row(p0, part, C, G, g, D, og + g * D);
    }
  });
  return out;
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> query_start_loc,
                                     int64_t sinks, c10::optional<torch::Tensor> q_sink) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q must be float32");
  const float* qsp = nullptr;
  int64_t qs_stride = 0;
  if (sinks > 0) {
    TORCH_CHECK(window > 0 && q_sink && q_sink->dtype() == torch::kFloat32 && q_sink->sizes() == q.sizes() &&
                    q_sink->stride(2) == 1 && q_sink->stride(1) == q.size(2),
                "attention sinks need a window and a float32 q_sink shaped like q with contiguous rows");
    qsp = q_sink->data_ptr<float>();
    qs_stride = q_sink->stride(0);
  }
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kFloat16),
              "K/V caches must both be float32 or both float16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [B, Hq, D] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  if (k_cache.dtype() == torch::kFloat16)
    return decode_attention_impl<at::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                           query_start_loc, sinks, qsp, qs_stride);
  return decode_attention_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                      query_start_loc, sinks, qsp, qs_stride);
}

// Decode attention (one or a few new tokens per sequence, as paged_decode_attention) over quantized
// K/V (kv_quant.h); `qlo` is per query row (each row reads the ring from its own bound, as a decode
// of its position would). Pool chunks of int8 read by attend_chunk_q8, of int4 dequantized into float
// rows; ring chunks read in place as float16.
torch::Tensor paged_decode_attention_quant(torch::Tensor q, std::vector<torch::Tensor> kv, torch::Tensor block_tables,
                                           torch::Tensor seq_lens, torch::Tensor slots, torch::Tensor qlo,
                                           int64_t ring_blocks, int64_t bits, double scale, int64_t window,
                                           double softcap, c10::optional<torch::Tensor> query_start_loc) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [B, Hq, D] with contiguous rows");
  auto sl = slots.to(torch::kInt64).contiguous(), ql = qlo.to(torch::kInt64).contiguous();
  TORCH_CHECK(ql.numel() == q.size(0), "quantized decode attention: one read bound (qlo) per query row");
  QuantKV qk = make_quant_kv(kv, ring_blocks, bits, q.size(2), sl, ql, block_tables.size(0));
  return decode_attention_impl<float>(q, kv[4], kv[5], block_tables, seq_lens, scale, window, softcap, query_start_loc,
                                      0, nullptr, 0, &qk);
}

// k, v: [T, Hk, D] (rows may be strided); caches [num_blocks, block_size, Hk, D]; token t goes to
// slot slot_mapping[t] (block id * block_size + offset). One call for both caches.
void paged_write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k and v, and the two caches, must share their dtypes");
  const bool to_half = k.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat16;
  TORCH_CHECK(to_half || k.scalar_type() == k_cache.scalar_type(),
              "k/v must have the cache's dtype (or be float32 for a float16 cache)");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [T, Hk, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v rows must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.numel() % row == 0 && k_cache.size(2) * k_cache.size(3) == row, "cache rows do not match k");
  const int64_t slots = k_cache.numel() / row, es = k.element_size(), ces = k_cache.element_size();
  auto sm = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(sm.numel() == T, "one slot per token");
  const int64_t* sp = sm.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = sp[t];
    TORCH_CHECK(s >= 0 && s < slots, "slot ", s, " out of range for a cache of ", slots, " slots");
    if (to_half) {  // round to nearest even, as Tensor.to(float16)
      const float* ks = reinterpret_cast<const float*>(kp + t * k.stride(0) * es);
      const float* vs = reinterpret_cast<const float*>(vp + t * v.stride(0) * es);
      at::Half* kd = reinterpret_cast<at::Half*>(kc + s * row * ces);
      at::Half* vd = reinterpret_cast<at::Half*>(vc + s * row * ces);
      int64_t i = 0;
#ifdef __F16C__
      // eight at a time, round to nearest even: the same bits as at::Half(float) for every finite value
      for (; i + 8 <= row; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(kd + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(ks + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(vd + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(vs + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
#endif
      for (; i < row; ++i) { kd[i] = at::Half(ks[i]); vd[i] = at::Half(vs[i]); }
    } else {
      std::memcpy(kc + s * row * es, kp + t * k.stride(0) * es, row * es);
      std::memcpy(vc + s * row * es, vp + t * v.stride(0) * es, row * es);
    }
  }
}
