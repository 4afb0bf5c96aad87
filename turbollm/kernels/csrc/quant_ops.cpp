// Torch-level entry points of the quantized-matmul kernels (declared in ops.h, bound in bindings.cpp).
//
// The only quantized-matmul translation unit that includes torch/extension.h. Argument checking
// lives here; turbollm/kernels/quant.py picks the path (q8 or dequant) and keeps the PyTorch reference.
// Weight formats: a GGML type id with uint8 w [N, row_bytes]; kInt8 (1000) with int8 w [N, K]
// and scale [N]; kInt4 (1001) with packed uint8 [N, K / 2] and kInt3 (1002) with packed uint8
// [N, K / 32 * 12] (packing.pack_3bit), both with float16 scale / uint8 zero [N, K / group].
#include <torch/extension.h>
#include <ATen/ThreadLocalState.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "ops.h"
#include "peak_loops.h"
#include "quant_common.h"
#include "repacked.h"

namespace {

using tq::TypeKernels;
using tq::WView;

const TypeKernels& kernels_for(int64_t qtype) {
  const TypeKernels* k = tq::find_kernels((int)qtype);
  TORCH_CHECK(k != nullptr, "turbollm_kernels: no kernel for type ", qtype);
  return *k;
}

WView make_view(const torch::Tensor& w, int64_t qtype, int64_t K, const c10::optional<torch::Tensor>& scale,
                const c10::optional<torch::Tensor>& zero, int64_t group, const TypeKernels& k) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "weight must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(K > 0 && K % k.block == 0, "K = ", K, " is not a multiple of the block size ", k.block);
  WView v;
  v.K = K;
  v.data = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const int64_t N = w.size(0);
  if (qtype == tq::kInt8) {
    TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.size(1) == K, "int8 weight must be int8 [N, K]");
    TORCH_CHECK(scale && scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() && scale->numel() == N,
                "int8 weight needs a float32 scale [N]");
    v.row_bytes = K;
    v.scale = scale->data_ptr<float>();
  } else if (qtype == tq::kInt4 || qtype == tq::kInt3) {
    const char* name = qtype == tq::kInt4 ? "int4" : "int3";
    v.row_bytes = K / k.block * k.bytes;  // K / 2 (int4), K / 32 * 12 (int3)
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.size(1) == v.row_bytes, name, " weight must be uint8 [N, ",
                v.row_bytes, "] for K = ", K);
    TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, name, " group must be a multiple of 32 dividing K");
    TORCH_CHECK(scale && scale->scalar_type() == torch::kFloat16 && scale->is_contiguous() &&
                    scale->numel() == N * (K / group), name, " weight needs float16 scales [N, K / group]");
    TORCH_CHECK(zero && zero->scalar_type() == torch::kUInt8 && zero->is_contiguous() &&
                    zero->numel() == N * (K / group), name, " weight needs uint8 zero points [N, K / group]");
    v.scale16 = reinterpret_cast<const uint8_t*>(scale->data_ptr());
    v.zero8 = zero->data_ptr<uint8_t>();
    v.group = group;
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kUInt8, "GGML weight must be uint8 [N, row_bytes]");
    v.row_bytes = K / k.block * k.bytes;
    TORCH_CHECK(w.size(1) == v.row_bytes, "weight rows hold ", w.size(1), " bytes, type needs ", v.row_bytes);
    TORCH_CHECK(qtype < tq::kRepacked || N % tq::kGroupRows == 0, "a repacked weight has a multiple of ",
                tq::kGroupRows, " rows, not ", N);
  }
  return v;
}

torch::Tensor check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "x must be float32 [M, K]");
  return x.contiguous();
}

torch::Tensor make_out(const c10::optional<torch::Tensor>& out, int64_t M, int64_t N) {
  if (!out) return torch::empty({M, N}, torch::kFloat32);
  TORCH_CHECK(out->scalar_type() == torch::kFloat32 && out->is_contiguous() && out->dim() == 2 &&
                  out->size(0) == M && out->size(1) == N, "out must be a contiguous float32 [M, N] tensor");
  return *out;
}

// Each block of 32 values as its 16 even-indexed values, then its 16 odd ones (TypeKernels::act_even_odd).
template <class V>
void even_odd_order(V* v, int64_t count) {
  V tmp[32];
  for (int64_t b = 0; b < count; b += 32) {
    for (int i = 0; i < 16; ++i) { tmp[i] = v[b + 2 * i]; tmp[16 + i] = v[b + 2 * i + 1]; }
    std::memcpy(v + b, tmp, sizeof(tmp));
  }
}

// The quantized activations, in buffers owned by the calling thread and reused between calls.
// With levels = 2 each row of x becomes two rows (x and its residual, quant_common.h); with
// levels = 16 they are 16-bit (q16 instead of q, with s32 and s16 whatever the block).
struct ActScratch {
  std::vector<int8_t> q;
  std::vector<int16_t> q16;
  std::vector<float> d, s32, s16, y2;
  std::vector<int16_t> bs16;
  std::vector<int32_t> init;
  tq::QAct quantize(const float* x, int64_t M, int64_t K, int64_t block, int64_t levels, bool even_odd) {
    auto grow = [](auto& v, int64_t n) { if ((int64_t)v.size() < n) v.resize(n); };
    const bool x16 = levels == 16;
    const int64_t R = x16 ? M : M * levels;
    tq::QActBuf buf;
    if (x16) {
      grow(q16, R * K);
      buf.q16 = q16.data();
    } else {
      grow(q, R * K);
      buf.q = q.data();
    }
    grow(d, R * K / block);
    buf.d = d.data();
    if (block == 32 || x16) {
      grow(s32, R * K / 32);
      grow(s16, R * K / 16);
      buf.s32 = s32.data();
      buf.s16 = s16.data();
    } else {
      grow(bs16, R * K / 16);
      buf.bs16 = bs16.data();
    }
    if (x16) tq::quantize_activations16(x, M, K, block, buf);
    else tq::quantize_activations(x, M, K, block, buf, levels == 2);
    if (even_odd) {
      if (x16) even_odd_order(buf.q16, R * K);
      else even_odd_order(buf.q, R * K);
    }
    tq::QAct a;
    a.q = buf.q; a.q16 = buf.q16; a.d = buf.d; a.s32 = buf.s32; a.s16 = buf.s16; a.bs16 = buf.bs16;
    a.K = K;
    a.block = block;
    return a;
  }
  // The same for a type with tile kernels: int8 levels in blocks of 32, plus its offset sums.
  tq::QAct quantize(const TypeKernels& k, const float* x, int64_t M, int64_t K, int64_t levels) {
    tq::QAct a = quantize(x, M, K, 32, levels, false);
    if (k.act_off) {
      const int64_t R = M * levels;
      if ((int64_t)init.size() < R * K / k.act_sub) init.resize(R * K / k.act_sub);
      tq::offset_sums(a.q, R, K, k.act_sub, k.act_off, init.data());
      a.init = init.data();
    }
    return a;
  }
};
thread_local ActScratch act_scratch;

}  // namespace

// x [M, K] -> block 32: (q int8 [R, K], d, s32 [R, K/32], s16 [R, K/16]);
//             block 256: (q, d [R, K/256], bs16 int16 [R, K/16]);
// R = M rows, or 2M with levels = 2 (rows 2m: x, 2m + 1: its residual).
// levels = 16: 16-bit activations -> (q int16 [M, K], d [M, K/block], s32 [M, K/32], s16 [M, K/16]).
std::vector<torch::Tensor> quantize_act(torch::Tensor x, int64_t block, int64_t levels) {
  TORCH_CHECK(block == 32 || block == 256, "block must be 32 or 256");
  TORCH_CHECK(levels == 1 || levels == 2 || levels == 16, "levels must be 1, 2 or 16");
  if (levels == 16) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) % block == 0, "x must be [M, K] with K a multiple of ", block);
    x = check_x(x, x.size(1));
    const int64_t M = x.size(0), K = x.size(1);
    auto q = torch::empty({M, K}, torch::kInt16);
    auto d = torch::empty({M, K / block}), s32 = torch::empty({M, K / 32}), s16 = torch::empty({M, K / 16});
    tq::QActBuf buf;
    buf.q16 = q.data_ptr<int16_t>(); buf.d = d.data_ptr<float>();
    buf.s32 = s32.data_ptr<float>(); buf.s16 = s16.data_ptr<float>();
    tq::quantize_activations16(x.data_ptr<float>(), M, K, block, buf);
    return {q, d, s32, s16};
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) % block == 0, "x must be [M, K] with K a multiple of ", block);
  x = check_x(x, x.size(1));
  const int64_t M = x.size(0), K = x.size(1), R = M * levels;
  auto q = torch::empty({R, K}, torch::kInt8);
  auto d = torch::empty({R, K / block});
  tq::QActBuf buf;
  buf.q = q.data_ptr<int8_t>();
  buf.d = d.data_ptr<float>();
  if (block == 32) {
    auto s32 = torch::empty({R, K / 32}), s16 = torch::empty({R, K / 16});
    buf.s32 = s32.data_ptr<float>();
    buf.s16 = s16.data_ptr<float>();
    tq::quantize_activations(x.data_ptr<float>(), M, K, block, buf, levels == 2);
    return {q, d, s32, s16};
  }
  auto bs16 = torch::empty({R, K / 16}, torch::kInt16);
  buf.bs16 = bs16.data_ptr<int16_t>();
  tq::quantize_activations(x.data_ptr<float>(), M, K, block, buf, levels == 2);
  return {q, d, bs16};
}

// levels = 1: int8 activations. levels = 2: x ~ d1 q1 + d2 q2, the two rows of a token side by
// side in one kernel call (each weight block is still decoded and read once), summed at the end.
// levels = 16: 16-bit activations (types with dot16 kernels: supported16).
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K,
                        c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> zero, int64_t group,
                        c10::optional<torch::Tensor> out, int64_t levels) {
  TORCH_CHECK(levels == 1 || levels == 2 || levels == 16, "levels must be 1, 2 or 16");
  const TypeKernels& k = kernels_for(qtype);
  TORCH_CHECK(k.dot[0] != nullptr || k.tile[0] != nullptr, "no dot kernel for type ", qtype);
  TORCH_CHECK(levels != 16 || k.dot16[0] != nullptr, "no 16-bit activation kernel for type ", qtype);
  const WView v = make_view(w, qtype, K, scale, zero, group, k);
  x = check_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  torch::Tensor y = make_out(out, M, N);
  if (M == 0 || N == 0) return y;
  const tq::QAct a = k.tile[0] ? act_scratch.quantize(k, x.data_ptr<float>(), M, K, levels)
                               : act_scratch.quantize(x.data_ptr<float>(), M, K, k.act_block, levels,
                                                      levels == 16 ? k.act_even_odd || k.act16_even_odd : k.act_even_odd);
  if (levels != 2) {
    tq::qgemm(k, v, N, a, M, y.data_ptr<float>());
    return y;
  }
  std::vector<float>& y2 = act_scratch.y2;
  if ((int64_t)y2.size() < 2 * M * N) y2.resize(2 * M * N);
  tq::qgemm(k, v, N, a, 2 * M, y2.data());
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r0 = y2.data() + 2 * m * N;
    const float* r1 = r0 + N;
    for (int64_t n = 0; n < N; ++n) yp[m * N + n] = r0[n] + r1[n];
  }
  return y;
}

// Each thread takes whole chunks of chunk_rows weight rows: decodes one into its own fp32
// scratch (L2-sized) and multiplies it with a single-threaded sgemm (intra-op parallelism is
// off inside at::parallel_for), so there is no fork/join per chunk.
torch::Tensor linear_dequant(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K,
                             c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> zero, int64_t group,
                             c10::optional<torch::Tensor> out, int64_t chunk_rows) {
  const TypeKernels& k = kernels_for(qtype);
  const WView v = make_view(w, qtype, K, scale, zero, group, k);
  x = check_x(x, K);
  const int64_t M = x.size(0), N = w.size(0);
  torch::Tensor y = make_out(out, M, N);
  if (M == 0 || N == 0) return y;
  const int64_t rc = std::max<int64_t>(1, std::min(chunk_rows, N));
  const int64_t chunks = (N + rc - 1) / rc;
  const at::ThreadLocalState caller_state;  // grad / inference mode of the caller, for the workers' mm
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    thread_local std::vector<float> scratch;
    if ((int64_t)scratch.size() < rc * K) scratch.resize(rc * K);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * rc, n1 = std::min(N, n0 + rc);
      for (int64_t n = n0; n < n1; ++n) k.deq(v, n, scratch.data() + (n - n0) * K);
      auto wc = torch::from_blob(scratch.data(), {n1 - n0, K}, torch::kFloat32);
      auto yc = y.narrow(1, n0, n1 - n0);
      at::mm_out(yc, x, wc.t());
    }
  });
  return y;
}

torch::Tensor dequant(torch::Tensor w, int64_t qtype, int64_t K, c10::optional<torch::Tensor> scale,
                      c10::optional<torch::Tensor> zero, int64_t group, c10::optional<torch::Tensor> out) {
  const TypeKernels& k = kernels_for(qtype);
  const WView v = make_view(w, qtype, K, scale, zero, group, k);
  const int64_t N = w.size(0);
  torch::Tensor y = make_out(out, N, K);
  if (N) tq::dequant_rows(k, v, 0, N, y.data_ptr<float>());
  return y;
}

torch::Tensor embedding(torch::Tensor w, int64_t qtype, int64_t K, torch::Tensor ids) {
  const TypeKernels& k = kernels_for(qtype);
  const WView v = make_view(w, qtype, K, c10::nullopt, c10::nullopt, 0, k);
  auto idx = ids.to(torch::kInt64).contiguous().view({-1});
  const int64_t count = idx.numel(), N = w.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<int64_t> rows(ip, ip + count);
  for (auto& r : rows) {
    TORCH_CHECK(r >= -N && r < N, "row index ", r, " out of range for a table of ", N, " rows");
    if (r < 0) r += N;
  }
  auto y = torch::empty({count, K}, torch::kFloat32);
  if (count) tq::gather_rows(k, v, rows.data(), count, y.data_ptr<float>());
  return y;
}

int64_t act_block(int64_t qtype) { return kernels_for(qtype).act_block; }

bool supported(int64_t qtype) {
  const TypeKernels* k = tq::find_kernels((int)qtype);
  return k != nullptr && (k->dot[0] != nullptr || k->tile[0] != nullptr);
}

std::vector<std::string> kernel_forms() {
  std::vector<std::string> forms;
#if defined(__AVX2__)
  forms.push_back("avx2");
  forms.push_back("avx2_tiles");
#endif
  if (tq::cpu_has_vnni512()) forms.push_back("avx512_vnni");
  if (tq::amx_ready()) forms.push_back("amx");
  return forms;
}

// whether `qtype` (a GGML id) has the repacked type `base` + qtype (kRepacked: avx512_vnni, kRepackedAmx:
// amx, kRepackedAvx2: avx2_tiles) with kernels this CPU runs
bool repackable(int64_t qtype, int64_t base) {
  if (qtype <= 0 || qtype >= tq::kRepacked || !tq::repackable((int)qtype)) return false;
  const TypeKernels* k = tq::find_kernels((int)(base + qtype));
  return k != nullptr && k->tile[0] != nullptr && (base != tq::kRepackedAmx || k->amx != nullptr);
}

// The view of a GGML weight whose type has a repacked layout (w holds its rows in either layout: the
// bytes per row are the same), checked for whole groups of 16 rows, and an output of its shape.
static std::pair<WView, torch::Tensor> repack_io(const torch::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype > 0 && qtype < tq::kRepacked && tq::repackable((int)qtype), "type ", qtype, " has no repacked layout");
  const WView v = make_view(w, qtype, K, c10::nullopt, c10::nullopt, 0, kernels_for(qtype));
  TORCH_CHECK(w.size(0) % tq::kGroupRows == 0, "repacked layouts take a multiple of ", tq::kGroupRows,
              " rows, not ", w.size(0));
  return {v, torch::empty_like(w)};
}

torch::Tensor repack(torch::Tensor w, int64_t qtype, int64_t K) {
  auto [v, out] = repack_io(w, qtype, K);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, w.size(0) / tq::kGroupRows, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t off = g * tq::kGroupRows * v.row_bytes;
      tq::repack_group((int)qtype, v.data + off, v.row_bytes, K, dst + off);
    }
  });
  return out;
}

torch::Tensor unrepack(torch::Tensor w, int64_t qtype, int64_t K) {
  auto [v, out] = repack_io(w, qtype, K);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, w.size(0), 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      tq::unrepack_row((int)qtype, v.data + (n / tq::kGroupRows) * tq::kGroupRows * v.row_bytes,
                       (int)(n % tq::kGroupRows), v.row_bytes, K, dst + n * v.row_bytes);
  });
  return out;
}

bool supported16(int64_t qtype) {
  const TypeKernels* k = tq::find_kernels((int)qtype);
  return k != nullptr && k->dot16[0] != nullptr;
}


// G operations (2 per multiply-add) per second of one instruction form's register-only loop run on
// `threads` threads at once for about `seconds`; 0 when the CPU lacks the instructions.
double peak_gops(const std::string& name, int64_t threads, double seconds) {
  const tq::peak::Loop* loop = tq::peak::find(name.c_str());
  TORCH_CHECK(loop != nullptr, "unknown peak loop ", name);
  if (!tq::peak::runs(*loop)) return 0.0;
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto t0 = now();
  volatile double sink = loop->run(1 << 16);
  const double per_iter = std::chrono::duration<double>(now() - t0).count() / (1 << 16);
  const int64_t n = std::max<int64_t>(1 << 16, (int64_t)(seconds / std::max(per_iter, 1e-12)));
  std::atomic<int64_t> done{0};
  t0 = now();
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      sink = loop->run(n);
      done += 1;
    }
  });
  const double dt = std::chrono::duration<double>(now() - t0).count();
  (void)sink;
  return 2.0 * loop->macs_per_iter * (double)n * (double)done.load() / dt / 1e9;
}
