// float32 x [M, K] @ W [N, K]^T (+ bias) for the few rows of a decode step, W float32 or bfloat16.
//
// The sgemm torch ships is tuned for many rows: at M = 1 it reads W at 8-13 GB/s of this
// machine's ~17 whatever torch's thread count, at M = 2 to 8 at 3.5-8 GB/s (docs/BENCHMARKS.md).
// Here each output row n is one pass over W[n] for up to kTile rows of x at once (8-wide FMAs,
// two accumulators per row of x), the rows of W split over torch's threads in tiles that every
// group of kTile rows of x visits while the tile is in cache; more than
// kDenseMaxRows (ops.h) rows of x go to at::linear. Up to that many rows, a row's result does not
// depend on the other rows of the batch. The dense float32 weights (linear method "none", GGUF F32
// parts, a dense LM head) take this in the module path and in the fused decode step alike, so the
// two stay bit-identical; its reference is F.linear (tests/test_dense_gemv.py).
//
// bfloat16 weights (dtype "bfloat16": quantization/dense_dtype.py) take the same passes, each weight widened
// to float32 in registers (a shift: bfloat16 is float32's upper half) and multiplied by the float32 row:
// half the bytes read per row, the products exact. Beyond kDenseMaxRows rows the product goes to at::linear
// in bfloat16 (oneDNN: AMX or AVX512_BF16 tiles where the CPU has them), x rounded to bfloat16 and the
// result widened back to float32 (then the bias, float32, added).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "ops.h"
#include "quant_common.h"

namespace tq {
namespace v512 {  // dense_gemv512.cpp: the AVX-512 form of the pass, the same bits
void dense_rows(int T, const float* w, const float* x, const float* bias, float* out, int64_t K, int64_t N,
                int64_t ldx, int64_t n0, int64_t n1, int64_t ahead);
void dense_rows(int T, const uint16_t* w, const float* x, const float* bias, float* out, int64_t K, int64_t N,
                int64_t ldx, int64_t n0, int64_t n1, int64_t ahead);
}  // namespace v512
}  // namespace tq

namespace {

constexpr int64_t kTile = 4;  // rows of x per pass over a tile of W
constexpr int64_t kRowTileBytes = 128 << 10;  // bytes of W per tile
// bytes of W prefetched ahead of the pass (into the rows that follow: a thread's rows are contiguous). A
// bfloat16 line takes three times float32's instructions (widening), so the out-of-order window alone keeps
// a third as many lines in flight: without it a row read 7.5 GB/s a core against float32's 11; with it the
// 49152 x 576 LM head reads 28-33 GB/s on two cores (Xeon, 2026-12-06; 1 KB ahead: 20, 8 KB: 27)
constexpr int64_t kAhead = 4096;
constexpr int64_t kWideRows = 12;  // rows of x from which dense_linear takes the AVX-512 pass (same bits)

#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // 8 bfloat16 -> float32: the 16 bits go to the top
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// Outputs n .. n + R - 1 (R rows of W at once) for T rows of x. Each output keeps two 8-wide accumulators
// over k (k mod 16) summed at the end, whatever T and R: R only adds independent chains (for one or two rows
// of x), so a result's bits do not depend on either. With the prefetch (kAhead) R = 2 reads bfloat16 rows 10-20%
// faster than R = 1 at one or two rows of x (Xeon, 2026-12-06, scripts/bench_dense.py; without the prefetch it
// made no difference).
template <int T, int R, typename W>
inline void outputs(const W* w, const float* x, const float* bias, float* out, int64_t K, int64_t N, int64_t ldx,
                    int64_t n) {
  float sum[R][T];
  int64_t k = 0;
#ifdef __AVX2__
  __m256 acc[R][T][2];
  for (int q = 0; q < R; ++q)
    for (int t = 0; t < T; ++t) acc[q][t][0] = acc[q][t][1] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    for (int q = 0; q < R; ++q) {
      const W* r = w + (n + q) * K;
      if (q == R - 1)  // the loads of the rows to come issued by hand (see kAhead)
        _mm_prefetch(reinterpret_cast<const char*>(r + k) + kAhead, _MM_HINT_T0);
      const __m256 w0 = load8(r + k), w1 = load8(r + k + 8);
      for (int t = 0; t < T; ++t) {
        acc[q][t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + k), acc[q][t][0]);
        acc[q][t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + k + 8), acc[q][t][1]);
      }
    }
  }
  for (int q = 0; q < R; ++q)
    for (int t = 0; t < T; ++t) sum[q][t] = tq::hsum(_mm256_add_ps(acc[q][t][0], acc[q][t][1]));
#else
  for (int q = 0; q < R; ++q)
    for (int t = 0; t < T; ++t) sum[q][t] = 0.f;
#endif
  for (int q = 0; q < R; ++q) {
    const W* r = w + (n + q) * K;
    for (int64_t kk = k; kk < K; ++kk)
      for (int t = 0; t < T; ++t) sum[q][t] += static_cast<float>(r[kk]) * x[t * ldx + kk];
    const float b = bias ? bias[n + q] : 0.f;
    for (int t = 0; t < T; ++t) out[t * N + n + q] = sum[q][t] + b;
  }
}

template <int T, typename W>
void rows_of_w(const W* w, const float* x, const float* bias, float* out, int64_t K, int64_t N,
               int64_t ldx, int64_t n0, int64_t n1) {
  constexpr int R = T <= 2 ? 2 : 1;  // at most 8 accumulators (of the 16 ymm registers)
  int64_t n = n0;
  for (; n + R <= n1; n += R) outputs<T, R>(w, x, bias, out, K, N, ldx, n);
  for (; n < n1; ++n) outputs<T, 1>(w, x, bias, out, K, N, ldx, n);
}

template <typename W>
using RowsFn = void (*)(const W*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template <typename W>
constexpr RowsFn<W> kRows[kTile] = {rows_of_w<1, W>, rows_of_w<2, W>, rows_of_w<3, W>, rows_of_w<4, W>};

inline const float* raw(const float* w) { return w; }
inline const uint16_t* raw(const at::BFloat16* w) { return reinterpret_cast<const uint16_t*>(w); }

template <typename W>
void gemv(const torch::Tensor& x, const W* wp, const float* bp, torch::Tensor& out, bool wide) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t ldx = x.stride(0);
  // each task a few hundred KB of W: enough to hide the fork / join, small enough to share out
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / K);
  // a tile of W's rows (in L2) meets every group of kTile rows of x before the next tile: W is read
  // from memory once per call whatever M
  const int64_t rt = std::max<int64_t>(1, kRowTileBytes / (K * (int64_t)sizeof(W)));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = n0; r0 < n1; r0 += rt) {
      const int64_t r1 = std::min(n1, r0 + rt);
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t t = std::min(kTile, M - m0);
        if (wide)
          tq::v512::dense_rows(static_cast<int>(t), raw(wp), xp + m0 * ldx, bp, op + m0 * N, K, N, ldx, r0, r1, kAhead);
        else
          kRows<W>[t - 1](wp, xp + m0 * ldx, bp, op + m0 * N, K, N, ldx, r0, r1);
      }
    }
  });
}

bool cpu_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

torch::Tensor linear_form(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool wide) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_linear: x [M, K] and W [N, K]");
  const int64_t M = x.size(0), N = w.size(0);
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  const bool plain = x.scalar_type() == torch::kFloat32 && (bf16 || w.scalar_type() == torch::kFloat32) &&
                     x.device().is_cpu() && w.is_contiguous() && x.stride(1) == 1 &&
                     (!bias || (bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N));
  if (plain && bf16 && M > kDenseMaxRows) {  // many rows: oneDNN's bfloat16 product, back to float32
    auto y = at::linear(x.to(torch::kBFloat16), w).to(torch::kFloat32);
    if (bias) y.add_(*bias);
    return y;
  }
  if (!plain || M == 0 || M > kDenseMaxRows) return bias ? at::linear(x, w, *bias) : at::linear(x, w);
  auto out = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  if (bf16)
    gemv<at::BFloat16>(x, w.data_ptr<at::BFloat16>(), bp, out, wide);
  else
    gemv<float>(x, w.data_ptr<float>(), bp, out, wide);
  return out;
}

}  // namespace

torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  // the AVX-512 pass from kWideRows rows: measured (Xeon, 2026-12-06, bfloat16 W) 1.1-1.2x the AVX2 pass at
  // 16 rows, 0.85-1.05x at 8, 0.8-1.0x at one (memory-bound: its four streams of W prefetch no better)
  return linear_form(x, w, bias, cpu_avx512() && x.dim() == 2 && x.size(0) >= kWideRows);
}

torch::Tensor dense_linear_form(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                const std::string& form) {
  TORCH_CHECK(form == "avx2" || form == "avx512", "dense_linear_form: form avx2 or avx512, not '", form, "'");
  TORCH_CHECK(form == "avx2" || cpu_avx512(), "dense_linear_form: this CPU lacks AVX-512 F/BW/VL/DQ");
  return linear_form(x, w, bias, form == "avx512");
}
