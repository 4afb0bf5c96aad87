// Paged attention for any number of new tokens per sequence: a chunk of prefill over a cached
// prefix, the k + 1 positions of speculative verification, decodes, mixed in one batch.
//
// FlashAttention's algorithm on the CPU: a task is (sequence, KV head, tile of up to kQTile new
// tokens), its rows the tile's tokens × the G = Hq / Hk query heads of the KV head (GQA/MQA by
// head grouping: each K/V row is read once for all of them). It walks the keys the tile can see
// in steps of kKTile positions, straight from the blocks its block table names, and keeps per row
// a running maximum m, a running sum l and an unnormalized output acc (online softmax: when m
// grows, l and acc are rescaled by exp(m_old - m_new)). Scores exist only for kKTile keys at a
// time: the extra memory is rows × kKTile floats per thread, never the L × S score matrix.
// Causal within the new tokens (token i of a sequence of L tokens, n of them new, sits at
// position L - n + i and sees positions <= its own), sliding windows (positions > p - window),
// soft-capping (cap * tanh(s / cap)), float32 or float16 K/V read in place.
//
// With few tasks (one sequence verifying a handful of tokens, or one long chunk with one KV head)
// the keys of a task are split in parts (split-K, as the decode kernel does) whose partial
// (m, l, acc) are merged afterwards, so every thread has work.
//
// With attention sinks (StreamingLLM: `sinks` > 0 with a window), a row at position p also sees the
// positions j < sinks older than its window, scored with its row of q_sink (the query rotated to the
// sinks' position): the first part of each task walks them before the window's keys, in the same
// online softmax.
// Reference: turbollm/attention/backend.py attend_one (tests/test_flash_attention.py holds them).
#include "ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_simd.h"
#include "kv_quant.h"

namespace {

constexpr int64_t kQTile = 16;   // new tokens per task
constexpr int64_t kKTile = 64;   // keys per step of a task
constexpr int64_t kMinSplit = 256;  // fewest keys in one part of a split task

struct TaskDef {
  int64_t b, h, i0, i1;  // sequence, KV head, its new tokens [i0, i1)
  int64_t k0, k1;        // the keys [k0, k1) this task covers
  int64_t part;          // index of its partial result (split tasks), -1: writes the output
  bool sinks;            // the first part of its tile: it walks the sink positions too
};

struct SinkArgs {
  int64_t sinks;     // sink positions (0: none)
  const float* q;    // q_sink rows (the query rotated to the sinks' position)
  int64_t stride;    // q_sink's row stride
};

template <class T>
void run_task(const TaskDef& tk, const float* qp, int64_t qstride, const T* kp, const T* vp, const int64_t* table,
              int64_t q0, int64_t first_pos, int64_t BS, int64_t Hk, int64_t G, int64_t D, float scale, float cap,
              int64_t window, const SinkArgs& sk, float* m, float* l, float* acc, std::vector<float>& scores,
              std::vector<const T*>& rows, std::vector<int64_t>& lo, std::vector<int64_t>& hi,
              const QuantKV* qk = nullptr, std::vector<float>* kbuf = nullptr, std::vector<float>* vbuf = nullptr) {
  const int64_t nq = tk.i1 - tk.i0, R = nq * G;
  const float ninf = -std::numeric_limits<float>::infinity();
  lo.resize(2 * R);
  hi.resize(2 * R);
  int64_t sink_top = 0;  // the sink positions [0, sink_top) some row of the tile sees
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t p = first_pos + tk.i0 + i;  // this token's position
    for (int64_t g = 0; g < G; ++g) {
      lo[i * G + g] = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      hi[i * G + g] = p + 1;  // keys [lo, hi) are visible
      lo[R + i * G + g] = 0;  // the sinks older than the window: [0, min(sinks, lo))
      hi[R + i * G + g] = tk.sinks ? std::min(sk.sinks, lo[i * G + g]) : 0;
      sink_top = std::max(sink_top, hi[R + i * G + g]);
    }
  }
  std::fill(m, m + R, ninf);
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + R * D, 0.f);
  scores.resize(R * kKTile);
  rows.resize(kKTile);
  int64_t off[kKTile];
  // keys [t0, t0 + n) for every row r (visible: [LO[r], HI[r])), queries from qbase's rows
  auto step = [&](int64_t t0, int64_t n, const float* qbase, int64_t qstr, const int64_t* LO, const int64_t* HI) {
    const T* kbase = kp;
    const T* vbase = vp;
    if constexpr (std::is_same_v<T, float>) {
      if (qk) {  // quantized K/V: the tile dequantized (or widened from the ring) into float rows
        kbuf->resize(n * D);
        vbuf->resize(n * D);
        load_quant_rows(*qk, table, qk->qlo[tk.b], qk->slot[tk.b], tk.h, t0, t0 + n, kbuf->data(), vbuf->data());
        kbase = kbuf->data();
        vbase = vbuf->data();
        for (int64_t j = 0; j < n; ++j) off[j] = j * D;
      }
    }
    if (!qk) {
      int64_t blk = t0 / BS, slot = t0 % BS;
      for (int64_t j = 0; j < n; ++j) {
        off[j] = ((table[blk] * BS + slot) * Hk + tk.h) * D;
        if (++slot == BS) { slot = 0; ++blk; }
      }
    }
    for (int64_t j = 0; j < n; ++j) rows[j] = kbase + off[j];
    // scores [R, n]
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        const float* q = qbase + (q0 + tk.i0 + i) * qstr + (tk.h * G + g) * D;
        float* s = scores.data() + r * n;
        const int64_t a = std::max<int64_t>(LO[r] - t0, 0), e = std::min<int64_t>(HI[r] - t0, n);
        int64_t j = 0;
#ifdef __AVX2__
        if (D % 8 == 0)
          for (; j + 8 <= n; j += 8) {
            if (j + 8 <= a || j >= e) continue;  // wholly masked for this row
            _mm256_storeu_ps(s + j, _mm256_mul_ps(dot8(q, rows.data() + j, D), _mm256_set1_ps(scale)));
          }
#endif
        for (; j < n; ++j)
          if (j >= a && j < e) s[j] = dot(q, rows[j], D) * scale;
        if (cap > 0.f)
          for (int64_t x = a; x < e; ++x) s[x] = std::tanh(s[x] / cap) * cap;
        for (int64_t x = 0; x < std::min(a, n); ++x) s[x] = ninf;
        for (int64_t x = std::max<int64_t>(e, 0); x < n; ++x) s[x] = ninf;
      }
    }
    // online softmax: rescale what the row has, add this step's exp(s - m)
    for (int64_t r = 0; r < R; ++r) {
      float* s = scores.data() + r * n;
      const int64_t a = std::max<int64_t>(LO[r] - t0, 0), e = std::min<int64_t>(HI[r] - t0, n);
      if (a >= e) {  // nothing visible to this row here
        std::fill(s, s + n, 0.f);
        continue;
      }
      float mx = m[r];
      for (int64_t x = a; x < e; ++x) mx = std::max(mx, s[x]);
      const float corr = m[r] == ninf ? 0.f : std::exp(m[r] - mx);
      const float sum = exp_sum(s, a, e, mx);
      std::fill(s, s + a, 0.f);
      std::fill(s + e, s + n, 0.f);
      if (corr != 1.f) {
        float* o = acc + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] *= corr;
      }
      l[r] = l[r] * corr + sum;
      m[r] = mx;
    }
    // acc += P V
    for (int64_t j = 0; j < n; ++j) rows[j] = vbase + off[j];
    accum_pv(rows.data(), scores.data(), n, R, acc, D);
  };
  for (int64_t t0 = 0; t0 < sink_top; t0 += kKTile)
    step(t0, std::min(kKTile, sink_top - t0), sk.q, sk.stride, lo.data() + R, hi.data() + R);
  for (int64_t t0 = tk.k0; t0 < tk.k1; t0 += kKTile)
    step(t0, std::min(kKTile, tk.k1 - t0), qp, qstride, lo.data(), hi.data());
}

template <class T>
torch::Tensor attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                             const torch::Tensor& seq_lens, double scale, int64_t window, double softcap,
                             const SinkArgs& sk, const QuantKV* qk = nullptr) {
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t B = lens.size(0), NT = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hk = k_cache.size(2), W = bt.size(1);
  TORCH_CHECK(qsl.numel() == B + 1 && bt.size(0) == B, "attention: one block table and query range per sequence");
  TORCH_CHECK(Hq % Hk == 0, "attention: query heads must be a multiple of KV heads");
  const int64_t G = Hq / Hk, qstride = q.stride(0);
  const int64_t* qs = qsl.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == NT, "attention: query_start_loc must cover the rows of q");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(qs[b + 1] >= qs[b] && lp[b] >= qs[b + 1] - qs[b] && (lp[b] + BS - 1) / BS <= W,
                "attention: sequence ", b, " has more new tokens than tokens, or more blocks than its table");
  auto out = torch::empty({NT, Hq, D}, q.options());

  // tasks: (sequence, KV head, query tile), split over the keys when there are few of them
  std::vector<TaskDef> tasks;
  int64_t whole = 0;
  for (int64_t b = 0; b < B; ++b) whole += Hk * ((qs[b + 1] - qs[b] + kQTile - 1) / kQTile);
  const int64_t want = 2 * at::get_num_threads();
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qs[b + 1] - qs[b], first = lp[b] - nq;
    for (int64_t i0 = 0; i0 < nq; i0 += kQTile) {
      const int64_t i1 = std::min(nq, i0 + kQTile);
      const int64_t k0 = window > 0 ? std::max<int64_t>(0, first + i0 - window + 1) : 0, k1 = first + i1;
      int64_t split = whole >= want ? 1 : std::min((want + whole - 1) / whole, std::max<int64_t>(1, (k1 - k0) / kMinSplit));
      const int64_t step = ((k1 - k0 + split - 1) / split + kKTile - 1) / kKTile * kKTile;
      split = (k1 - k0 + step - 1) / step;
      for (int64_t h = 0; h < Hk; ++h)
        for (int64_t s = 0; s < split; ++s)
          tasks.push_back({b, h, i0, i1, k0 + s * step, std::min(k1, k0 + (s + 1) * step), split > 1 ? parts++ : -1,
                           sk.sinks > 0 && s == 0});
    }
  }
  const int64_t rows_max = kQTile * G;
  std::vector<float> partial(parts * rows_max * (D + 2));
  const float* qp = q.data_ptr<float>();
  const T* kp = qk ? nullptr : k_cache.data_ptr<T>();
  const T* vp = qk ? nullptr : v_cache.data_ptr<T>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, own(rows_max * (D + 2)), kbuf, vbuf;
    std::vector<const T*> rows;
    std::vector<int64_t> lo, hi;
    for (int64_t j = begin; j < end; ++j) {
      const TaskDef& tk = tasks[j];
      const int64_t nq = tk.i1 - tk.i0, R = nq * G;
      float* buf = tk.part >= 0 ? partial.data() + tk.part * rows_max * (D + 2) : own.data();
      float *m = buf, *l = buf + R, *acc = buf + 2 * R;
      run_task<T>(tk, qp, qstride, kp, vp, btp + tk.b * W, qs[tk.b], lp[tk.b] - (qs[tk.b + 1] - qs[tk.b]), BS, Hk,
                  G, D, fscale, cap, window, sk, m, l, acc, scores, rows, lo, hi, qk, &kbuf, &vbuf);
      if (tk.part >= 0) continue;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          float* o = op + ((qs[tk.b] + tk.i0 + i) * Hq + tk.h * G + g) * D;
          const float inv = 1.f / l[r];
          for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
        }
    }
  });
  if (parts == 0) return out;
  // merge the parts of each split (sequence, head, tile), consecutive in `tasks`
  for (size_t j = 0; j < tasks.size();) {
    size_t e = j;
    while (e < tasks.size() && tasks[e].part >= 0 && tasks[e].b == tasks[j].b && tasks[e].h == tasks[j].h &&
           tasks[e].i0 == tasks[j].i0)
      ++e;
    if (e == j) { ++j; continue; }
    const TaskDef& tk = tasks[j];
    const int64_t nq = tk.i1 - tk.i0, R = nq * G, stride = rows_max * (D + 2);
    const float* base = partial.data() + tk.part * stride;  // the parts of one split are numbered in a row
    for (int64_t r = 0; r < R; ++r) {
      float* o = op + ((qs[tk.b] + tk.i0 + r / G) * Hq + tk.h * G + r % G) * D;
      std::fill(o, o + D, 0.f);
      merge_parts_row(base, stride, (int64_t)(e - j), R, r, D, o);
    }
    j = e;
  }
  return out;
}

}  // namespace

// The tiled kernel over quantized K/V (kv_quant.h): each key tile dequantized (or widened from the
// ring) into float rows, then attended as float K/V.
torch::Tensor paged_attention_quant(torch::Tensor q, std::vector<torch::Tensor> kv, torch::Tensor block_tables,
                                    torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor slots,
                                    torch::Tensor qlo, int64_t ring_blocks, int64_t bits, double scale,
                                    int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float32 [T, Hq, D] with contiguous rows");
  auto sl = slots.to(torch::kInt64).contiguous(), ql = qlo.to(torch::kInt64).contiguous();
  const QuantKV qk = make_quant_kv(kv, ring_blocks, bits, q.size(2), sl, ql, seq_lens.numel());
  return attention_impl<float>(q, kv[4], kv[5], block_tables, query_start_loc, seq_lens, scale, window, softcap,
                               SinkArgs{0, nullptr, 0}, &qk);
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                              double scale, int64_t window, double softcap, int64_t sinks,
                              c10::optional<torch::Tensor> q_sink) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q must be float32");
  SinkArgs sk{0, nullptr, 0};
  if (sinks > 0) {
    TORCH_CHECK(window > 0 && q_sink && q_sink->dtype() == torch::kFloat32 && q_sink->sizes() == q.sizes() &&
                    q_sink->stride(2) == 1 && q_sink->stride(1) == q.size(2),
                "attention sinks need a window and a float32 q_sink shaped like q with contiguous rows");
    sk = {sinks, q_sink->data_ptr<float>(), q_sink->stride(0)};
  }
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype() &&
                  (k_cache.dtype() == torch::kFloat32 || k_cache.dtype() == torch::kFloat16),
              "K/V caches must both be float32 or both float16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, Hq, D] with contiguous rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "contiguous [N, BS, Hk, D] caches");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches must share the head dim");
  if (k_cache.dtype() == torch::kFloat16)
    return attention_impl<at::Half>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window, softcap,
                                    sk);
  return attention_impl<float>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window, softcap, sk);
}
