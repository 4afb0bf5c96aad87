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
// soft-capping (cap * tanh(s / cap)), float32 K/V read in place or float16 K/V widened per step.
//
// A step (attention_tile.h) holds the task's rows in vector lanes, the queries transposed once per task:
// each score and each output element is one lane's chain of fused multiply-adds, register-blocked over
// rows and keys for the scores and over rows and columns for P V (attention_tile.h). Its AVX-512 form
// (flash_attention512.cpp), AVX2 form and portable form give the same bits; the widest the CPU runs is
// taken (set_attention_isa forces one, for tests and benchmarks).
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
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_simd.h"
#include "attention_tile.h"
#include "kv_quant.h"

namespace atile {
void step_avx512(const Step& s);  // flash_attention512.cpp
}

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

// The key step's form: 0 portable, 1 AVX2, 2 AVX-512 (attention_tile.h: the same bits in each); -1 until
// chosen, then the widest the CPU runs unless set_attention_isa named one.
std::atomic<int> g_isa{-1};

int widest_isa() {
#ifdef __AVX2__
  if (__builtin_cpu_supports("avx512f")) return 2;
  return 1;
#else
  return 0;
#endif
}

int attention_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) g_isa.store(isa = widest_isa(), std::memory_order_relaxed);
  return isa;
}

void run_step(const atile::Step& s) {
  switch (attention_isa()) {
#ifdef __AVX2__
    case 2: atile::step_avx512(s); break;
    case 1: atile::step<atile::Vec8>(s); break;
#endif
    default: atile::step<atile::VecS>(s); break;
  }
}

// Per-thread scratch of a task.
struct Scratch {
  std::vector<float> qt, qt_sink, kf, vf, st, cr, m, l;
  std::vector<int64_t> lo, hi, a, e;
  std::vector<const float*> krows, vrows;
};

// Rows [0, R) of the tile as qt[D][Rp] (row r = token i * G + head g; pad rows zero).
void transpose_queries(const float* qbase, int64_t qstr, int64_t first_row, int64_t h, int64_t nq, int64_t G,
                       int64_t D, int64_t Rp, std::vector<float>& qt) {
  qt.assign(D * Rp, 0.f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const float* q = qbase + (first_row + i) * qstr + (h * G + g) * D;
      const int64_t r = i * G + g;
      for (int64_t d = 0; d < D; ++d) qt[d * Rp + r] = q[d];
    }
}

// n cache rows (element offsets off[j]) as float32 rows dst[j * D ..]
template <class T>
void widen_rows(const T* base, const int64_t* off, int64_t n, int64_t D, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const T* src = base + off[j];
    float* o = dst + j * D;
    int64_t d = 0;
#ifdef __AVX2__
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, load8(src + d));
#endif
    for (; d < D; ++d) o[d] = to_f32(src[d]);
  }
}

template <class T>
void run_task(const TaskDef& tk, const float* qp, int64_t qstride, const T* kp, const T* vp, const int64_t* table,
              int64_t q0, int64_t first_pos, int64_t BS, int64_t Hk, int64_t G, int64_t D, float scale, float cap,
              int64_t window, const SinkArgs& sk, float* m, float* l, float* acc, Scratch& w,
              const QuantKV* qk = nullptr) {
  const int64_t nq = tk.i1 - tk.i0, R = nq * G, Rp = (R + 15) / 16 * 16;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t>&lo = w.lo, &hi = w.hi;
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
  w.m.assign(Rp, ninf);
  w.l.assign(Rp, 0.f);
  w.cr.resize(Rp);
  w.st.resize(kKTile * Rp);
  w.kf.resize(kKTile * D);
  w.vf.resize(kKTile * D);
  w.a.resize(Rp);
  w.e.resize(Rp);
  w.krows.resize(kKTile);
  w.vrows.resize(kKTile);
  std::fill(acc, acc + R * D, 0.f);
  transpose_queries(qp, qstride, q0 + tk.i0, tk.h, nq, G, D, Rp, w.qt);
  if (sink_top > 0) transpose_queries(sk.q, sk.stride, q0 + tk.i0, tk.h, nq, G, D, Rp, w.qt_sink);
  int64_t off[kKTile];
  // keys [t0, t0 + n) for every row r (visible: [LO[r], HI[r])), queries qt
  auto step = [&](int64_t t0, int64_t n, const std::vector<float>& qt, const int64_t* LO, const int64_t* HI) {
    auto from_buffers = [&] {  // the step's rows are those of kf / vf
      for (int64_t j = 0; j < n; ++j) {
        w.krows[j] = w.kf.data() + j * D;
        w.vrows[j] = w.vf.data() + j * D;
      }
    };
    if (qk) {  // quantized K/V: the step's rows dequantized (or widened from the ring) into float rows
      if constexpr (std::is_same_v<T, float>)
        load_quant_rows(*qk, table, qk->qlo[tk.b], qk->slot[tk.b], tk.h, t0, t0 + n, w.kf.data(), w.vf.data());
      from_buffers();
    } else {
      int64_t blk = t0 / BS, slot = t0 % BS;
      for (int64_t j = 0; j < n; ++j) {
        off[j] = ((table[blk] * BS + slot) * Hk + tk.h) * D;
        if (++slot == BS) { slot = 0; ++blk; }
      }
      if constexpr (std::is_same_v<T, float>) {  // float32 K/V: read in place
        for (int64_t j = 0; j < n; ++j) {
          w.krows[j] = kp + off[j];
          w.vrows[j] = vp + off[j];
        }
      } else {  // float16: widened
        widen_rows(kp, off, n, D, w.kf.data());
        widen_rows(vp, off, n, D, w.vf.data());
        from_buffers();
      }
    }
    for (int64_t r = 0; r < Rp; ++r) {
      if (r >= R) { w.a[r] = 0; w.e[r] = n; continue; }  // pad rows (zero queries; never read back)
      const int64_t e = std::clamp<int64_t>(HI[r] - t0, 0, n);
      w.a[r] = std::min(std::clamp<int64_t>(LO[r] - t0, 0, n), e);
      w.e[r] = e;
    }
    const atile::Step s{qt.data(), w.krows.data(), w.vrows.data(), w.a.data(), w.e.data(), R, Rp, D, n, scale, cap,
                        w.st.data(), w.cr.data(), w.m.data(), w.l.data(), acc};
    run_step(s);
  };
  for (int64_t t0 = 0; t0 < sink_top; t0 += kKTile)
    step(t0, std::min(kKTile, sink_top - t0), w.qt_sink, lo.data() + R, hi.data() + R);
  for (int64_t t0 = tk.k0; t0 < tk.k1; t0 += kKTile)
    step(t0, std::min(kKTile, tk.k1 - t0), w.qt, lo.data(), hi.data());
  std::copy(w.m.begin(), w.m.begin() + R, m);
  std::copy(w.l.begin(), w.l.begin() + R, l);
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

  // Threads take tasks one at a time, dearest first (keys x rows): a causal prompt's tiles cost in proportion
  // to their position, and equal contiguous shares of them left one thread three times the other's work.
  // Each task writes only its own rows or partial, so which thread runs it changes nothing in the result.
  std::vector<int64_t> order(tasks.size());
  for (size_t j = 0; j < tasks.size(); ++j) order[j] = (int64_t)j;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const TaskDef &x = tasks[a], &y = tasks[b];
    return (x.k1 - x.k0) * (x.i1 - x.i0) > (y.k1 - y.k0) * (y.i1 - y.i0);
  });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (int64_t)tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> own(rows_max * (D + 2));
    Scratch w;
    for (int64_t n = next++; n < (int64_t)order.size(); n = next++) {
      const TaskDef& tk = tasks[order[n]];
      const int64_t nq = tk.i1 - tk.i0, R = nq * G;
      float* buf = tk.part >= 0 ? partial.data() + tk.part * rows_max * (D + 2) : own.data();
      float *m = buf, *l = buf + R, *acc = buf + 2 * R;
      run_task<T>(tk, qp, qstride, kp, vp, btp + tk.b * W, qs[tk.b], lp[tk.b] - (qs[tk.b + 1] - qs[tk.b]), BS, Hk,
                  G, D, fscale, cap, window, sk, m, l, acc, w, qk);
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

std::string set_attention_isa(const std::string& isa) {
  static const char* const kNames[] = {"portable", "avx2", "avx512"};
  int want = -1;
  for (int i = 0; i < 3; ++i)
    if (isa == kNames[i]) want = i;
  TORCH_CHECK(want >= 0 || isa == "auto", "set_attention_isa: 'auto', 'portable', 'avx2' or 'avx512', not '", isa, "'");
  if (want < 0) want = widest_isa();
  TORCH_CHECK(want <= widest_isa(), "set_attention_isa: this CPU or build does not run the ", isa, " form");
  int before = g_isa.exchange(want);
  return kNames[before < 0 ? widest_isa() : before];
}

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
